"""Trainer: everything a run needs, built from a TrainConfig and checked before step 1 (the run directory, the log
sinks, the batch arithmetic, the data, the model and its optimizer, a resumed checkpoint), and ``run()``, which
trains (loop.py) and releases what the run holds."""
from __future__ import annotations

import datetime
import os
import random
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megakern.checkpoint import CheckpointError, CheckpointManager
from megakern.config import ConfigError, TrainConfig, to_dict, to_yaml
from megakern.data import PretrainingSampler, build_data, build_dataloader, check_ranks_agree, to_batch
from megakern.train.figures import StepFigures
from megakern.train.graph import StepGraph, check_graph, parallel_graph_problems, resolve_cuda_graph
from megakern.train.log import RunLogger, WandbOptions, peak_flops
from megakern.train.loop import Loop, RunResult
from megakern.train.run_dir import claim_run_dirs
from megakern.train.runtime import resolve_device, resolve_precision, setup_distributed
from megakern.train.schedule import LRSchedule
from megakern.train.state import resume, save
from megakern.train.step import TrainStep
from megakern.train.stopping import Interrupted, StopSignals, StopVote


class Trainer:
    """Builds everything a run needs from ``config`` (failing before step 1 on anything that would fail later) and
    runs it with ``run()``. ``profile``: run log.profile_wait + warmup + active steps under torch.profiler and stop.
    ``stream``: where the console lines go (default stdout); ``signals``: SIGTERM / SIGINT requests (main()
    installs the handlers; a Trainer made elsewhere gets none).
    """

    def __init__(self, config: TrainConfig, *, profile: bool = False, stream=None,
                 signals: StopSignals | None = None):
        self.config, self.profiling = config, profile
        c, t = config, config.train
        t0 = time.perf_counter_ns()
        self.device = resolve_device(t.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.env = setup_distributed(c, self.device)
        self.precision = resolve_precision(t.precision, self.device)
        # train.cuda_graph 'auto' decided here: everything after (the step, the layout, the loop) sees true or false
        c, self.graph_note = resolve_cuda_graph(c, self.device, self.env.world)
        self.config, t = c, c.train
        check_parallel_options(c, self.precision, self.env.world)
        self.signals = signals if signals is not None else StopSignals()
        self.vote = self.graph = self.manager = None

        # run directory: named by rank 0 for every rank and locked for the run's life (a second run is refused
        # before it writes anything); then the logger (contract 29, docs/contracts.md: every sink checked now)
        self.dirs = claim_run_dirs(c.log.run_dir, c.checkpoint.dir, writer=self.env.writer,
                                   distributed=dist.is_available() and dist.is_initialized())
        self.run_dir, self.ckpt_dir = self.dirs.run_dir, self.dirs.ckpt_dir
        try:
            wandb = None if not c.log.wandb else WandbOptions(
                c.log.wandb_project, entity=c.log.wandb_entity, name=c.log.wandb_name or self.run_dir.name,
                mode=c.log.wandb_mode)
            self.logger = RunLogger(self.run_dir, tensorboard=c.log.tensorboard, progress=c.log.progress,
                                    total_steps=t.steps, enabled=self.env.writer, stream=stream, wandb=wandb,
                                    run_config=to_dict(c))
        except BaseException:
            self.dirs.release()
            raise
        self.log = self.logger.line
        try:
            self._setup(t0)
        except BaseException as exc:  # the reason reaches train.log too, then everything is released
            self.log_error(exc)
            self.close(failed=True)
            raise

    def _setup(self, t0: int) -> None:
        """Everything after the run directory and the logger (the rest of the constructor)."""
        c, t = self.config, self.config.train
        for note in self.dirs.notes():
            self.log(note)
        if self.graph_note:
            self.log(self.graph_note)
        self.config_yaml = to_yaml(c)
        if self.env.writer:
            (self.run_dir / "config.yaml").write_text(self.config_yaml)
            self.log("resolved config:\n" + self.config_yaml.rstrip())
            ep = f", ep {c.parallel.ep}" if c.parallel.ep > 1 else ""
            layout = (f"{self.env.world} ranks (tp {c.parallel.tp}, pp {c.parallel.pp}, cp {c.parallel.cp}, dp "
                      f"{self.env.dp_size}{ep})" if self.env.world > 1 else "1 process")
            self.log(f"run directory {self.run_dir} (checkpoints in {self.ckpt_dir}); device {self.device}, "
                     f"precision {self.precision}, {layout}")
        # every rank votes after each step on stopping (a signal on any rank, data changed on any rank)
        self.vote = StopVote(self.env.world > 1, timeout=datetime.timedelta(seconds=c.parallel.init_timeout_s))

        # batch arithmetic: a step is accum micro-batches of micro_batch_size on each data-parallel rank
        self.seq_length = t.seq_length or c.model.max_seqlen
        self.eval_seq_length = c.eval.seq_length or self.seq_length
        micro_total = t.micro_batch_size * self.env.dp_size
        self.global_batch = t.global_batch_size or micro_total
        if self.global_batch % micro_total:
            raise ConfigError(f"train.global_batch_size {self.global_batch} is not a multiple of train.micro_batch_size "
                              f"{t.micro_batch_size} x data-parallel size {self.env.dp_size} = {micro_total}")
        self.accum = self.global_batch // micro_total
        self.eval_mbs = c.eval.micro_batch_size or t.micro_batch_size
        # a rank draws its whole step batch; megakern.parallel cuts it into micro-batches itself
        self.microbatches = c.parallel.microbatches or self.accum
        self.draw = t.micro_batch_size * self.accum
        # an eval batch is one micro-batch (eval.batches of them), under a pipeline its schedule's micro-batches
        self.eval_draw = self.eval_mbs * (self.microbatches if c.parallel.pp > 1 else 1)
        if self.draw % self.microbatches:
            raise ConfigError(f"parallel.microbatches {self.microbatches} does not divide a rank's step batch of "
                              f"{self.draw} sequences (train.global_batch_size / data-parallel size)")
        self.tokens_per_step = self.global_batch * self.seq_length

        # seeds: the same weights on every rank; dropout streams differ per rank
        torch.manual_seed(t.seed + self.env.rank)
        random.seed(t.seed + self.env.rank)
        np.random.seed((t.seed + self.env.rank) % 2**32)

        # data
        self.data = build_data(c, seq_length=self.seq_length, eval_seq_length=self.eval_seq_length,
                               train_samples=t.steps * self.global_batch,
                               eval_samples=c.eval.batches * self.eval_draw * self.env.dp_size, log=self.log)
        self.log(f"data: {self.data.description}; fingerprint {self.data.fingerprint}")
        self.eod_id = self.data.tokenizer.eod_id if c.data.packed_documents else None
        try:  # the final sample's prompt, checked now rather than after the run
            self.prompt_ids = self.data.tokenizer.encode(t.sample_prompt) or [self.data.tokenizer.eod_id]
        except ValueError as exc:
            raise ConfigError(f"train.sample_prompt {t.sample_prompt!r}: {exc}") from None

        # the model, its precision and optimizer, and the step on them
        self.stepper = TrainStep(c, device=self.device, precision=self.precision, env=self.env, accum=self.accum,
                                 microbatches=self.microbatches, eod_id=self.eod_id,
                                 generator=torch.Generator().manual_seed(t.seed), log=self.log,
                                 profiling=self.profiling)
        self.model = self.stepper.model
        self.flops_per_token = self.stepper.flops_per_token(self.seq_length)
        self.peak, peak_note = peak_flops(self.device)
        if self.peak is None:
            self.log(f"MFU: n/a ({peak_note})")
        self.schedule = LRSchedule(c.schedule, lr=c.optim.lr, total_steps=t.steps)
        if t.cuda_graph:
            check_graph(c, self.stepper)
            self.graph = StepGraph(self.stepper, t.cuda_graph_warmup, log=self.log,
                                   replay_timeout=c.parallel.init_timeout_s if self.env.world > 1 else None)
        active = (f", {self.stepper.n_active / 1e6:.2f}M active per token: {c.model.moe_top_k} of "
                  f"{c.model.n_experts} experts" if c.model.n_experts else "")
        self.log(f"model: {self.stepper.n_params / 1e6:.2f}M parameters ({self.stepper.n_body / 1e6:.2f}M without "
                 f"embeddings{active}), {self.flops_per_token / 1e6:.1f} MFLOP per token; global batch "
                 f"{self.global_batch} x "
                 f"{self.seq_length} tokens = {self.accum} accumulation step(s) of {t.micro_batch_size} x "
                 f"{self.env.dp_size} data-parallel rank(s)")

        # checkpoints and resume; then every rank must agree on the data and where it starts (contract 12)
        self.manager = CheckpointManager(self.ckpt_dir, keep=c.checkpoint.keep, log=self.log)
        self.manager.remove_leftovers()  # what killed saves and removals left (hidden names; one log line each)
        self.step, self.consumed_samples, self.nonfinite_total = 0, 0, 0
        resume(self)
        check_ranks_agree(self.data.fingerprint, self.consumed_samples, timeout=c.parallel.init_timeout_s)
        self.log(f"ready in {(time.perf_counter_ns() - t0) / 1e9:.1f} s")

    # -- what the loop and the tests call -------------------------------------------------------------------------
    def batches(self, dataset, consumed: int, micro_batch_size: int):
        """An iterator over ``dataset``'s samples for this data-parallel rank, from ``consumed`` samples on, in draws
        of ``micro_batch_size``."""
        sampler = PretrainingSampler(len(dataset), consumed, micro_batch_size, self.env.dp_rank, self.env.dp_size)
        with warnings.catch_warnings(record=True) as caught:  # contract 32: the cap is logged, not just warned
            warnings.simplefilter("always")
            loader = build_dataloader(dataset, sampler, num_workers=self.config.data.num_workers,
                                      timeout=self.config.data.loader_timeout_s)
        # the loader's own generator: making an iterator would otherwise draw from the global RNG (dropout's)
        loader.generator = torch.Generator().manual_seed(self.config.train.seed)
        for w in caught:
            self.log(f"note: {w.message}")
        return iter(loader)

    def train_step(self, batches) -> StepFigures:
        """One optimizer step on the next draws of ``batches`` (``batches(...)``'s iterator), queued: its (loss,
        gradient norm, stepped) figures, ``.read()`` on the host. The loss is the mean over the global batch."""
        self.stepper.set_lr(self.schedule(self.step))
        samples = [next(batches) for _ in range(self.stepper.draws)]
        runner = self.graph if self.graph is not None else self.stepper
        return runner.run(samples, self.step + 1)

    def save(self, asynchronous: bool | None = None) -> Path:
        """Checkpoint this step (every rank). ``asynchronous`` (default checkpoint.async_save): the tensors are
        staged into CPU memory now and written in the background (the next save, the run's end or a stop waits
        for it and raises its failure); the final save and a signal's save are synchronous. Returns the
        checkpoint's directory (complete once a background save has finished)."""
        asynchronous = self.config.checkpoint.async_save if asynchronous is None else asynchronous
        saved = save(self, asynchronous)
        if asynchronous:
            self.log(f"checkpoint: {saved.path} (writing in the background)")
            return saved.path
        self.log(f"checkpoint: {saved}")
        return saved

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> torch.Tensor:
        """Mean held-out loss over eval.batches micro-batches (the same samples every time; ``batches``: the first
        so many) of every data-parallel rank: a float32 scalar on the CPU (contract 33, docs/contracts.md). The
        model's train/eval mode is restored."""
        count = self.config.eval.batches if batches is None else batches
        was_training = self.model.training
        self.stepper.set_training(False)
        try:
            total = torch.zeros((), device=self.device, dtype=torch.float32)
            draws = self.batches(self.data.valid, 0, self.eval_draw)
            for _ in range(count):
                total += self.stepper.eval_loss(to_batch(next(draws), self.device, self.eod_id))
            total /= count
            return total.cpu()
        finally:
            self.stepper.set_training(was_training)

    def sample(self) -> str | None:
        """The final sample: train.sample_tokens tokens after train.sample_prompt, decoded."""
        t = self.config.train
        if t.sample_tokens == 0:
            return None
        if self.env.world > 1:
            p = self.config.parallel
            if max(p.tp, p.pp, p.cp, p.ep) > 1 or p.dp_shard != "ddp":
                self.log("sample: skipped, the model is sharded over ranks (tp/pp/cp/ep or FSDP)")
                return None
            if not self.env.writer:
                return None
        from megakern.models.generate import generate

        tok, prompt = self.data.tokenizer, self.prompt_ids
        length = min(t.sample_tokens, self.config.model.max_seqlen - len(prompt))
        if length < 1:
            self.log(f"sample: skipped, the prompt's {len(prompt)} tokens fill model.max_seqlen")
            return None
        idx = torch.tensor([prompt], dtype=torch.long, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(t.seed)
        with self.stepper.autocast, torch.compiler.set_stance("force_eager"):  # compiled blocks run eagerly here
            out = generate(self.model, idx, length, temperature=t.sample_temperature, top_k=t.sample_top_k,
                           generator=gen, eos_id=tok.eod_id)
        return tok.decode(out[0, len(prompt):].tolist())

    # -- the run --------------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Train from the current step to train.steps (or profile a few steps); see megakern.train. Everything the
        run holds (log sinks, the run directory's lock, the vote's group) is released at the end, also when the run
        stops on an error (which goes to the log file too) or on a second signal."""
        failed = True
        try:
            result = Loop(self).run()
            if self.graph is not None:
                self.graph.release()
            failed = False
            return result
        except BaseException as exc:
            self.log_error(exc)
            raise
        finally:
            self.close(failed=failed)

    def close(self, failed: bool = False) -> None:
        """Release what the run holds: the vote's process group, the log sinks (``failed``: the run ended on an
        error, which a Weights & Biases run records), the directories' locks. Idempotent; ``run()`` and a failed
        constructor call it."""
        if self.manager is not None and self.manager.pending is not None:
            try:  # a background save still running (the run stopped on an error): it ends before anything else
                self.manager.wait()
            except CheckpointError as exc:
                self.log(f"error: {exc}")
        if self.vote is not None:
            self.vote.close()
            self.vote = None
        self.logger.close(failed=failed)
        self.dirs.release()

    def log_error(self, exc: BaseException) -> None:
        """One line in the log for the error that ends the run."""
        if isinstance(exc, (KeyboardInterrupt, Interrupted)):
            self.log(f"stopped: {exc or type(exc).__name__} (no checkpoint written by this stop)")
        else:
            self.log(f"error: {type(exc).__name__}: {exc}")


def check_parallel_options(config: TrainConfig, precision: str, world: int) -> None:
    """ConfigError naming what cannot work in this run's layout over ``world`` ranks, and why. Changes nothing."""
    c, p, problems = config, config.parallel, []
    if world > 1:
        problems += parallel_graph_problems(c, world)
    if p.ep > 1:
        if p.zero1:
            problems.append(f"parallel.ep={p.ep} with parallel.zero1: ZeRO-1 broadcasts each parameter from one dp x "
                            "cp rank, but each ep rank holds other experts; use parallel.zero1=false")
        if c.train.cuda_graph is True and c.model.moe_capacity_factor is None:
            problems.append(f"parallel.ep={p.ep} with train.cuda_graph needs model.moe_capacity_factor: the dropless "
                            "all-to-all dispatch reads its split sizes on the host (one read per MoE layer and "
                            "micro-batch), which a CUDA graph cannot capture; with a capacity factor the dispatch has "
                            "fixed sizes")
    if p.fsdp_param_dtype == "bfloat16" and precision == "fp32":
        problems.append("parallel.fsdp_param_dtype=bfloat16 computes the blocks in bf16, which an fp32 run's "
                        "residual stream cannot enter; use train.precision=bf16 or bf16-autocast")
    if problems:
        where = f"a run over {world} ranks" if world > 1 else "this run"
        raise ConfigError(f"{where}: " + "; ".join(problems))
