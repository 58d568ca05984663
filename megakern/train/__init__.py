"""megakern's training program: a GPT built from megakern's kernels, trained on one device (or under torchrun).

    python -m megakern.train                                   # gpt-tiny on the default corpus: minutes on a CPU
    megakern-train --config configs/gpt-125m.yaml optim.lr=6e-4 train.steps=5000
    megakern-train --config configs/gpt-tiny.yaml --profile    # a few steps under torch.profiler -> profiles/
    megakern-train --help-config                               # every config key, its type, default and doc

Flow: config (megakern.config) -> data (megakern.data: the default corpus or PREFIX.bin/.idx files, split by
documents into train / held-out, GPTDataset or BlendedDataset, PretrainingSampler) -> model (GPT on the meta device)
-> megakern.parallel.parallelize over the run's mesh (one process: a local mesh of ones), which materializes and
initializes it once and gives it its precision (fp32 | bf16 autocast | bf16 weights with fp32 master weights),
optional FP8 linears and torch.compile of the blocks -> AdamW + LR schedule ->
resume from a checkpoint -> the loop -> final eval, checkpoint and a text sample.

One optimizer step, with A = global_batch / (micro_batch x data-parallel size) accumulation steps:

    for each of A micro-batches:   forward (loss summed over its tokens) -> backward of loss / N (N: the global
                                   batch's tokens; bf16 weights: gradients accumulated in fp32 masters)
    grad norm (clipped to train.grad_clip) -> found_inf = loss or norm not finite (on the device)
    finite: AdamW step at the schedule's lr;  not finite: the step is skipped and counted, and
    train.max_nonfinite skipped steps in a row stop the run with an error saying what to change

No host-device sync in a step on one device with fused AdamW (the default on CUDA): the model is told the data
pipeline checked every token id (``check_values=False``), fused AdamW skips the update itself when found_inf is set
(the same device-side skip as torch.amp.GradScaler's), and (loss, norm, skipped) travel to pinned host memory behind
an event, read after the next step is queued: the log, the skip count and the halt run one step behind the device.
The same holds over several ranks (megakern.parallel), where loss and norm are reduced over every group so that all
ranks skip alike. Other optimizers (foreach, for-loop, ZeRO-1's) read the figures at the end of each step and skip
the update on the host. Because nothing is read, the whole step can be captured in a CUDA graph and replayed
(``train.cuda_graph``: graph.StepGraph), which takes the host's launch cost out of the step; over several ranks too
(tensor, context and DDP data parallelism), with their NCCL collectives in the graph.

In every run the model is megakern.parallel's ParallelModel (one process and several ranks alike): a rank draws its
whole step batch (A micro-batches) and ``forward_backward`` cuts it into parallel.microbatches (pipeline
micro-batches or accumulation), returning the global mean loss; clipping spans every group. Checkpoints hold the single model's names
and shapes, so a run may resume under another layout (or in one process). Each rank's dropout RNG tracker
(megakern.parallel.rng) is saved with its RNG states and restored under the same layout, so a resumed run draws
the uninterrupted run's masks; under another layout it starts from the seed again (one log line says so).

Every stage is checked before step 1 (the numbers are contracts of docs/contracts.md): the config's keys and types,
the run directory (named by rank 0 for every rank, every rank seeing the same paths, and locked for the run's life:
megakern.train.run_dir), the log sinks (29), the samples the run needs against what the data holds within data.max_epochs
(26) and what eval reads against the held-out set, eval lengths against model.max_seqlen (28), DataLoader workers
against the CPUs (32) and a timeout on their batches (2), the data fingerprint against a resumed checkpoint's (34)
and across data-parallel ranks (12). An error is one ``megakern-train: error:`` line and, once the run directory
exists, the same line in train.log.

During the run: after every step each rank stats the data files (11, 34; a few microseconds) and the ranks vote, in
one host-side all-reduce read a step later (megakern.train.stopping), on whether to stop: a change found by any rank stops
every rank before a checkpoint can record data the run did not train on (found at most two steps late; before a
checkpoint the vote is settled at once); a SIGTERM / SIGINT received by any rank finishes the step on every rank,
saves a checkpoint and exits with EXIT_INTERRUPTED (75). After the
first step, an eval micro-batch larger than a training one is tried once on GPUs (28). A resume keeps the
checkpoint's LR schedule unless schedule.on_resume=config, and says what it does from there. Each step's time is its
own, on this rank's clock or CUDA events (StepClock; 1, 9).

The package, a file a job: cli (the console script), trainer (Trainer: the run built and checked), loop (the steps,
evals, checkpoints and the checks between steps), step (TrainStep: the model, its precision and optimizer, one
optimizer step), graph (the step in a CUDA graph), figures (a step's figures and time), runtime (device, precision,
ranks), optimizer (parameter groups and the AdamW implementation), state (checkpoints of a run and resuming), schedule
(the LR schedule), run_dir (the run directory and its lock), stopping (signals and the ranks' vote), log (the log
sinks), profile and timeline (--profile and its GPU-time split). Data splitting and batches: megakern.data.
"""
from megakern.train.cli import main, parse_args
from megakern.train.figures import StepClock, StepFigures, StepTime, wait_for_event
from megakern.train.graph import StepGraph, parallel_graph_problems
from megakern.train.loop import RunResult, TrainingHalted
from megakern.train.optimizer import device_skip, param_groups
from megakern.train.runtime import resolve_device, resolve_precision
from megakern.train.state import restore_dropout_rng
from megakern.train.step import TrainStep
from megakern.train.trainer import Trainer, check_parallel_options

__all__ = [
    "RunResult", "StepClock", "StepFigures", "StepGraph", "StepTime", "TrainStep", "Trainer", "TrainingHalted",
    "check_parallel_options", "device_skip", "main", "param_groups", "parallel_graph_problems", "parse_args",
    "resolve_device", "resolve_precision", "restore_dropout_rng", "wait_for_event",
]
