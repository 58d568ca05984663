"""The training program on CPU: loss falls, golden losses of gpt-tiny, exact resume, non-finite steps, start-up
checks (data size, vocabulary, loggers, workers, fingerprints), profiling, packed documents, the command line.

Golden losses: tests/train/golden_gpt_tiny.json holds the first 20 losses of configs/gpt-tiny.yaml on CPU (fp32).
After an intended change of the model, the data pipeline or the loop, regenerate it with

    python tests/train/test_train.py --write-golden

and say why in the commit.
"""
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from megakern.train import log as _log
from megakern.train import timeline as _timeline
from megakern.checkpoint import CheckpointError
from megakern.train.log import read_records
from megakern.config import ConfigError, load_config
from megakern.data import DataError
from megakern.data.corpus import default_corpus_id
from megakern.train.run_dir import RunDirError
from megakern.data import document_offsets
from megakern.train import Trainer
from benchmarks.common import stop_launch

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden_gpt_tiny.json")
GOLDEN_STEPS = 20
GOLDEN_ATOL = 1e-4  # fp32 on CPU is deterministic; this leaves room for other CPUs' kernels, not for any real change
QUIET = ["log.tensorboard=false", "log.progress=false", "train.sample_tokens=0", "data.num_workers=0",
         "train.device=cpu"]
TINY = QUIET + ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.max_seqlen=64",
                "train.micro_batch_size=8", "optim.lr=3e-3", "schedule.warmup_steps=10", "eval.batches=4"]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def trainer(tmp_path, data_cache, *overrides, config_file=None, name="run", profile=False):
    config = load_config(config_file, [*overrides, f"log.run_dir={tmp_path / name}", f"data.cache_dir={data_cache}"])
    return Trainer(config, profile=profile, stream=open(tmp_path / f"{name}.console", "a"))


def start(cmd: list[str]) -> subprocess.Popen:
    """``cmd`` (a torchrun) started from the repository in a session of its own, one OMP thread a process, its output
    to temporary files (launches that run at once never block on a full pipe); ``finish`` waits for it."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    proc.files = (out, err)
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """The exit code and output of ``proc`` (from ``start``). Past ``timeout`` the launch is stopped with its ranks
    (benchmarks.common's ``stop_launch``), and the test fails with what it printed."""
    try:
        proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        stop_launch(proc)
        timed_out = True
    for f in proc.files:
        f.seek(0)
    out, err = (f.read() for f in proc.files)
    for f in proc.files:
        f.close()
    if timed_out:
        pytest.fail(f"still running after {timeout:g} s, killed with its ranks: {' '.join(proc.args)}\n"
                    f"{out[-3000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def launch(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` (a torchrun) run as ``start`` and ``finish`` do."""
    return finish(start(cmd), timeout)


def golden_run(run_dir: Path, data_cache: Path) -> list[float]:
    config = load_config(REPO / "configs" / "gpt-tiny.yaml",
                         QUIET + [f"train.steps={GOLDEN_STEPS}", "eval.every=0", "checkpoint.final=false",
                                  f"log.run_dir={run_dir}", f"data.cache_dir={data_cache}"])
    # the first 20 steps of the 300-step preset run are these: they are all in warmup, and the data covers whole
    # epochs whatever train.steps is
    assert config.schedule.warmup_steps >= GOLDEN_STEPS
    result = Trainer(config, stream=open(run_dir.parent / "golden.console", "a")).run()
    return [result.losses[s] for s in range(1, GOLDEN_STEPS + 1)]


def test_tiny_run_loss_falls(tmp_path, data_cache):
    t = trainer(tmp_path, data_cache, *TINY, "train.steps=80", "eval.every=40", "checkpoint.final=false",
                "train.sample_tokens=40", "train.sample_prompt=import ")
    result = t.run()
    losses = [result.losses[s] for s in range(1, 81)]
    assert losses[0] > 5.0  # ln(257) = 5.55 at the start
    assert sum(losses[-10:]) / 10 < 3.3
    assert set(result.eval_losses) == {40, 80} and result.eval_losses[80] < 3.5
    assert result.skipped_steps == [] and result.final_step == 80
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step     80/80 | loss" in log and "eval loss" in log and "MFU n/a" in log
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert isinstance(result.sample, str) and 0 < len(result.sample.encode()) <= 40
    assert f"sample ({len(result.sample)} characters after 'import '):\nimport {result.sample}" in log


def test_golden_losses_gpt_tiny(tmp_path, data_cache):
    if not GOLDEN.is_file():
        pytest.fail(f"{GOLDEN} is missing; write it with: python tests/train/test_train.py --write-golden")
    golden = json.loads(GOLDEN.read_text())
    assert golden["steps"] == GOLDEN_STEPS
    if golden["corpus"] != default_corpus_id():  # the default corpus is this Python's standard library
        pytest.skip(f"the golden losses were recorded on the default corpus {golden['corpus']}; this machine's is "
                    f"{default_corpus_id()} (another Python version)")
    losses = golden_run(tmp_path / "run", data_cache)
    worst = max(abs(a - b) for a, b in zip(losses, golden["losses"]))
    assert worst <= GOLDEN_ATOL, (f"losses differ from {GOLDEN.name} by up to {worst:.2e}:\n"
                                  + "\n".join(f"  step {i + 1}: {a:.7f} golden {b:.7f}"
                                              for i, (a, b) in enumerate(zip(losses, golden["losses"]))))


@pytest.mark.parametrize("precision, workers, optim", [("fp32", 0, "auto"), ("bf16", 1, "auto"),
                                                       ("bf16-autocast", 0, "auto"), ("bf16", 0, "megakern")])
def test_exact_resume(tmp_path, data_cache, precision, workers, optim):
    """Stopping at step 6 and resuming gives the same losses, bit for bit (dropout, accumulation, workers; and
    megakern's master-weight AdamW, whose state is loaded into torch's layout and its tables rebuilt)."""
    if optim == "megakern":
        from conftest import require_triton

        require_triton(torch.device("cpu"))
    common = [*TINY, "model.dropout=0.1", "train.global_batch_size=16", "train.steps=12", "eval.every=0",
              f"train.precision={precision}", f"data.num_workers={workers}", f"optim.fused={optim}"]
    whole = trainer(tmp_path, data_cache, *common, "checkpoint.every=6", "checkpoint.final=false", name="a").run()
    resumed_trainer = trainer(tmp_path, data_cache, *common,
                              f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000006'}", name="b")
    assert resumed_trainer.step == 6 and resumed_trainer.consumed_samples == 6 * 16
    resumed = resumed_trainer.run()
    assert sorted(resumed.losses) == list(range(7, 13))
    assert [resumed.losses[s] for s in range(7, 13)] == [whole.losses[s] for s in range(7, 13)]


def test_resume_auto_and_nothing_left(tmp_path, data_cache):
    first = trainer(tmp_path, data_cache, *TINY, "train.steps=3", "eval.every=0", "checkpoint.resume=auto").run()
    assert first.final_step == 3 and first.checkpoint.endswith("step_00000003")
    again = trainer(tmp_path, data_cache, *TINY, "train.steps=3", "eval.every=0", "checkpoint.resume=auto")
    assert again.step == 3
    nothing = again.run()
    assert nothing.losses == {} and nothing.checkpoint is None  # no step run: nothing saved again


@pytest.mark.filterwarnings("ignore:fp8.Linear")  # no FP8 GEMMs on a CPU: a plain linear, with the scaling state
def test_fp8_scaling_state_is_checkpointed(tmp_path, data_cache):
    from megakern.checkpoint import checkpoint_keys

    common = [*TINY, "train.fp8=delayed", "eval.every=0"]
    first = trainer(tmp_path, data_cache, *common, "train.steps=2", name="a")
    assert first.stepper.has_fp8
    with torch.no_grad():  # scaling state as FP8 hardware would leave it (a CPU run, without FP8 GEMMs, keeps it)
        for name, buffer in first.model.named_buffers():
            if name.endswith(("amax_history", "scale")):
                buffer.copy_(torch.rand_like(buffer))
    path = Path(first.run().checkpoint)
    assert any(k.startswith("buffers.blocks.0.") and k.endswith("amax_history") for k in checkpoint_keys(path))
    resumed = trainer(tmp_path, data_cache, *common, "train.steps=3", f"checkpoint.resume={path}", name="b")
    state, before = resumed.model.state_dict(), first.model.state_dict()
    scaling = [k for k in before if k.endswith(("amax_history", "scale"))]
    assert scaling and all(torch.equal(state[k], before[k]) for k in scaling)


def test_grad_accumulation_matches_one_big_batch(tmp_path, data_cache):
    common = [*TINY, "train.steps=3", "eval.every=0", "checkpoint.final=false"]
    big = trainer(tmp_path, data_cache, *common, "train.micro_batch_size=8", name="big").run()
    accumulated = trainer(tmp_path, data_cache, *common, "train.micro_batch_size=2", "train.global_batch_size=8",
                          name="acc").run()
    for s in (1, 2, 3):
        assert accumulated.losses[s] == pytest.approx(big.losses[s], abs=1e-5)


def _small_dataset(prefix: Path, seed: int, docs: int = 40) -> Path:
    from megakern.data import load_tokenizer
    from megakern.data.preprocess import preprocess_documents

    rng = random.Random(seed)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "value", "x", "print"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(200, 400))) for _ in range(docs)]
    preprocess_documents(texts, load_tokenizer("byte"), prefix, progress=False)
    return prefix


def test_blend_of_two_datasets(tmp_path, data_cache):
    a, b = _small_dataset(tmp_path / "a", 1), _small_dataset(tmp_path / "b", 2)
    t = trainer(tmp_path, data_cache, *TINY, f"data.paths=[{a}, {b}]", "data.weights=[3, 1]", "train.steps=3",
                "eval.every=3", "checkpoint.final=false")
    assert len(t.data.train) == 3 * 8 and "blend:" in t.data.description
    result = t.run()
    assert all(math.isfinite(v) for v in result.losses.values()) and 3 in result.eval_losses
    with pytest.raises(DataError, match=r"tokenized by char.* a run needs one tokenizer"):
        from megakern.data import CharTokenizer
        from megakern.data.preprocess import preprocess_documents

        preprocess_documents(["abc cab"] * 4, CharTokenizer("abc "), tmp_path / "c", progress=False)
        trainer(tmp_path, data_cache, *TINY, f"data.paths=[{a}, {tmp_path / 'c'}]", name="mixed")
    with pytest.raises(DataError, match="missing; datasets from megakern.data.preprocess carry their tokenizer"):
        trainer(tmp_path, data_cache, *TINY, f"data.paths=[{tmp_path / 'nothing'}]", name="missing")


def test_too_few_samples_is_an_error_at_start(tmp_path, data_cache):
    with pytest.raises(DataError, match=r"the run needs 800000 samples .* set data.max_epochs=\d+ to repeat the data"):
        trainer(tmp_path, data_cache, *TINY, "train.steps=100000")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_vocabulary_must_cover_the_tokenizer(tmp_path, data_cache):
    with pytest.raises(ConfigError, match="model.vocab_size 200 is smaller than the tokenizer's 257 ids"):
        trainer(tmp_path, data_cache, *TINY, "model.vocab_size=200")


def test_logger_that_cannot_start_fails_before_training(tmp_path, data_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(_log.LoggerError, match="log.tensorboard=true but TensorBoard cannot be imported"):
        trainer(tmp_path, data_cache, *TINY, "log.tensorboard=true")
    monkeypatch.undo()
    (tmp_path / "blocked").write_text("a file where the run directory should go")
    with pytest.raises(RunDirError, match="cannot create the lock file of the run directory .*blocked"):
        trainer(tmp_path, data_cache, *TINY, name="blocked")
    (tmp_path / "unwritable").mkdir()
    (tmp_path / "unwritable" / "train.log").mkdir()  # the log file cannot be opened
    with pytest.raises(_log.LoggerError, match="cannot write the log file"):
        trainer(tmp_path, data_cache, *TINY, name="unwritable")


def test_tensorboard_scalars(tmp_path, data_cache):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer(tmp_path, data_cache, *TINY, "log.tensorboard=true", "train.steps=4", "eval.every=2",
            "checkpoint.final=false").run()
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "eval/loss"):
        assert tag in scalars
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]


def test_workers_are_capped_to_the_cpus(tmp_path, data_cache):
    t = trainer(tmp_path, data_cache, *TINY, "data.num_workers=512", "train.steps=1", "eval.every=0",
                "checkpoint.final=false")
    t.run()
    assert "note: num_workers=512 exceeds the" in (tmp_path / "run" / "train.log").read_text()


def test_resume_refuses_other_data_and_other_models(tmp_path, data_cache):
    trainer(tmp_path, data_cache, *TINY, "train.steps=2", "eval.every=0", name="base").run()
    ckpt = tmp_path / "base" / "checkpoints"
    with pytest.raises(DataError, match="the data's fingerprint .* differs from the checkpoint's"):
        trainer(tmp_path, data_cache, *TINY, "train.steps=4", "data.split_seed=7", f"checkpoint.resume={ckpt}",
                name="other-data")
    with pytest.warns(UserWarning, match="differs from the checkpoint's"):
        t = trainer(tmp_path, data_cache, *TINY, "train.steps=4", "data.split_seed=7", f"checkpoint.resume={ckpt}",
                    "data.allow_fingerprint_change=true", name="allowed")
    assert t.step == 2
    with pytest.raises(CheckpointError, match="holds another model:\n  model.n_layer: 2 in the checkpoint, 3 now"):
        trainer(tmp_path, data_cache, *TINY, "model.n_layer=3", f"checkpoint.resume={ckpt}", name="other-model")
    with pytest.raises(CheckpointError, match="no complete checkpoint there"):
        trainer(tmp_path, data_cache, *TINY, f"checkpoint.resume={tmp_path / 'nowhere'}", name="nowhere")


def test_evaluate_returns_fp32_cpu_and_restores_mode(tmp_path, data_cache):
    t = trainer(tmp_path, data_cache, *TINY, "train.precision=bf16")
    for mode in (True, False):
        t.model.train(mode)
        loss = t.evaluate()
        assert loss.dtype == torch.float32 and loss.device.type == "cpu" and loss.dim() == 0
        assert t.model.training is mode and math.isfinite(loss.item())


def test_profile_writes_trace_and_kernel_table(tmp_path, data_cache):
    t = trainer(tmp_path, data_cache, *TINY, "log.profile_wait=1", "log.profile_warmup=1", "log.profile_active=2",
                f"log.profile_dir={tmp_path / 'profiles'}", profile=True)
    result = t.run()
    assert result.final_step == 4 and result.checkpoint is None
    out = Path(result.profile_dir)
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"data", "forward", "backward", "optimizer"} <= names
    table = (out / "kernels.txt").read_text()
    assert "forward" in table and "Self CPU" in table


def test_document_offsets():
    eod = 9
    inputs = torch.tensor([[1, 2, 9, 3, 4], [9, 5, 6, 7, 9]])
    cu, longest = document_offsets(inputs, eod)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 10] and longest == 4
    cu, longest = document_offsets(torch.tensor([[1, 2, 3]]), eod)
    assert cu.tolist() == [0, 3] and longest == 3


def test_packed_documents_run(tmp_path, data_cache):
    t = trainer(tmp_path, data_cache, *TINY, "data.packed_documents=true", "train.steps=3", "eval.every=3",
                "checkpoint.final=false")
    result = t.run()
    assert all(math.isfinite(v) for v in result.losses.values()) and 3 in result.eval_losses


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H200", 989.4e12),
                                        ("NVIDIA H100 PCIe", 756.5e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("NVIDIA GH200 480GB", 989.4e12), ("NVIDIA L4", 121e12),
                                        ("NVIDIA L40S", 362.05e12)])
def test_peak_flops_by_gpu_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert _log.peak_flops(torch.device("cuda", 0)) == (peak, name)


def test_peak_flops_unknown(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Imaginary GPU 9000")
    flops, why = _log.peak_flops(torch.device("cuda", 0))
    assert flops is None and "not in megakern.train.log.PEAK_BF16_FLOPS" in why
    assert _log.peak_flops(torch.device("cpu"))[0] is None


def test_command_line(tmp_path, data_cache):
    cmd = [sys.executable, "-m", "megakern.train", *TINY, "train.steps=3", "log.every=1", "eval.every=0",
           f"log.run_dir={tmp_path / 'cli'}", f"data.cache_dir={data_cache}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step      3/3 | loss" in proc.stdout and "checkpoint: " in proc.stdout
    assert "resolved config:\nformat_version: 1\nmodel:\n  n_layer: 2" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "megakern.train", "train.stpes=3"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "unknown config key 'train.stpes' (did you mean 'train.steps'" in bad.stderr


GPU = ["train.device=cuda", "train.cuda_graph=false"]  # eager steps unless a test asks for the graph


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
def test_gpu_tiny_run_loss_falls_with_mfu(tmp_path, data_cache, precision):
    t = trainer(tmp_path, data_cache, *TINY, *GPU, f"train.precision={precision}", "train.steps=80", "eval.every=40",
                "checkpoint.final=false", "train.sample_tokens=40")
    result = t.run()
    assert sum(result.losses[s] for s in range(71, 81)) / 10 < 3.3 and result.eval_losses[80] < 3.5
    assert isinstance(result.sample, str)
    log = (tmp_path / "run" / "train.log").read_text()
    if t.peak is not None:
        assert "MFU n/a" not in log and "peak alloc" in log


@pytest.mark.gpu
def test_gpu_compiled_step_matches_eager(tmp_path, data_cache):
    common = [*TINY, *GPU, "train.precision=bf16", "train.steps=3", "eval.every=0", "checkpoint.final=false"]
    eager = trainer(tmp_path, data_cache, *common, name="eager").run()
    compiled = trainer(tmp_path, data_cache, *common, "train.compile=true", name="compiled").run()
    for s in (1, 2, 3):
        assert compiled.losses[s] == pytest.approx(eager.losses[s], abs=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,accum", [("bf16", 1), ("bf16", 2), ("bf16-autocast", 2)])
def test_gpu_cuda_graph_step_matches_eager(tmp_path, data_cache, precision, accum):
    """train.cuda_graph: 2 eager steps, then the captured step replayed, with 1 or 2 micro-batches (bf16 weights:
    the master step reads the bf16 gradients, or the fp32 master gradients), clipping, an eval and a checkpoint
    between replays: the losses of the eager run; the run resumes from the graph run's checkpoint."""
    common = [*TINY, *GPU, f"train.precision={precision}", "train.steps=8", f"train.global_batch_size={8 * accum}",
              "train.grad_clip=0.5", "eval.every=4", "checkpoint.every=4", "checkpoint.final=false",
              "train.sample_tokens=0"]
    eager = trainer(tmp_path, data_cache, *common, name="eager").run()
    graphed = trainer(tmp_path, data_cache, *common, "train.cuda_graph=true", "train.cuda_graph_warmup=2",
                      name="graph").run()
    assert f"step 3: captured the training step in a CUDA graph ({accum} micro-batch(es))" in (
        tmp_path / "graph" / "train.log").read_text()
    assert sorted(graphed.losses) == list(range(1, 9))
    for s in range(1, 9):  # the same kernels on the same data (attention's backward may sum in another order)
        assert graphed.losses[s] == pytest.approx(eager.losses[s], abs=5e-3), s
    assert graphed.eval_losses[4] == pytest.approx(eager.eval_losses[4], abs=5e-3)
    resumed = trainer(tmp_path, data_cache, *common, "train.cuda_graph=true", "train.cuda_graph_warmup=1",
                      f"checkpoint.resume={tmp_path / 'graph' / 'checkpoints' / 'step_00000004'}", name="resumed").run()
    for s in range(5, 9):
        assert resumed.losses[s] == pytest.approx(eager.losses[s], abs=5e-3), s


def test_cuda_graph_refused_where_it_cannot_run(tmp_path, data_cache):
    with pytest.raises(ConfigError, match="train.cuda_graph needs a CUDA device"):
        trainer(tmp_path, data_cache, *TINY, "train.device=cpu", "train.cuda_graph=true")
    with pytest.raises(ConfigError, match="train.cuda_graph_warmup must be >= 1"):
        trainer(tmp_path, data_cache, *TINY, "train.device=cpu", "train.cuda_graph=true", "train.cuda_graph_warmup=0")


@pytest.mark.parametrize("overrides,device,world,reasons", [
    ([], "cpu", 1, ["a CUDA device (train.device is cpu)"]),
    (["optim.fused=foreach"], "cuda", 1, ["fused AdamW (optim.fused is foreach; auto, megakern or fused)"]),
    (["train.compile=true", "train.fp8=delayed"], "cuda", 1, ["no train.compile", "no FP8 (train.fp8 is delayed)"]),
    (["data.packed_documents=true"], "cuda", 1, ["fixed shapes (data.packed_documents varies them)"]),
    (["train.steps=3"], "cuda", 1, ["(train.steps 3 <= train.cuda_graph_warmup 3)"]),
    (["parallel.pp=2", "model.dropout=0.0"], "cuda", 2, ["not parallel.pp=2"]),
    (["parallel.dp=2", "parallel.dp_shard=ddp", "model.dropout=0.0"], "cuda", 2,
     ["needs train.cuda_graph_warmup >= 11, got 3"]),
    (["parallel.ep=2", "parallel.dp_shard=ddp", "model.n_experts=4", "model.moe_top_k=2", "model.dropout=0.0"],
     "cuda", 2, ["a capacity factor under parallel.ep=2", "needs train.cuda_graph_warmup >= 11"]),
])
def test_cuda_graph_auto_falls_back_naming_why(overrides, device, world, reasons):
    """train.cuda_graph 'auto' (the default) is off wherever train.cuda_graph=true would be refused or capture
    nothing, with every reason in its one log line."""
    from megakern.train.graph import resolve_cuda_graph

    config = load_config(None, overrides)
    assert config.train.cuda_graph == "auto"
    resolved, note = resolve_cuda_graph(config, torch.device(device), world)
    assert resolved.train.cuda_graph is False
    assert note.startswith("train.cuda_graph auto: eager steps, because ")
    for reason in reasons:
        assert reason in note, note


@pytest.mark.parametrize("overrides,world", [
    ([], 1), (["train.precision=bf16-autocast", "train.global_batch_size=16"], 1),
    (["parallel.tp=2", "model.dropout=0.0"], 2),
    (["parallel.dp=2", "parallel.dp_shard=ddp", "model.dropout=0.0", "train.cuda_graph_warmup=11"], 2)])
def test_cuda_graph_auto_captures_where_it_can(overrides, world):
    from megakern.train.graph import resolve_cuda_graph

    resolved, note = resolve_cuda_graph(load_config(None, overrides), torch.device("cuda"), world)
    assert resolved.train.cuda_graph is True
    assert note.startswith("train.cuda_graph auto: the step is captured in a CUDA graph after "), note
    for value in (True, False):  # given values pass through, with nothing to log
        config = load_config(None, [*overrides, f"train.cuda_graph={str(value).lower()}"])
        assert resolve_cuda_graph(config, torch.device("cuda"), world) == (config, None)


def test_cuda_graph_auto_logs_its_choice(tmp_path, data_cache):
    t = trainer(tmp_path, data_cache, *TINY)
    try:
        assert t.config.train.cuda_graph is False and t.graph is None
        log = (tmp_path / "run" / "train.log").read_text()
        assert "train.cuda_graph auto: eager steps, because a CUDA graph needs a CUDA device (train.device is cpu)" in log
    finally:
        t.close()


@pytest.mark.gpu
def test_gpu_cuda_graph_is_the_default(tmp_path, data_cache):
    """On a GPU the default run captures its step (after 3 eager steps) and says so, evaluates between replays and
    samples at the end; its losses are the eager run's."""
    common = [*TINY, "train.device=cuda", "train.steps=6", "eval.every=3", "checkpoint.final=false",
              "train.sample_tokens=20"]
    default = trainer(tmp_path, data_cache, *common, name="default").run()
    log = (tmp_path / "default" / "train.log").read_text()
    assert "train.cuda_graph auto: the step is captured in a CUDA graph after 3 eager step(s)" in log
    assert "step 4: captured the training step in a CUDA graph" in log
    eager = trainer(tmp_path, data_cache, *common, "train.cuda_graph=false", name="eager").run()
    for s in range(1, 7):
        assert default.losses[s] == pytest.approx(eager.losses[s], abs=5e-3), s
    assert sorted(default.eval_losses) == sorted(eager.eval_losses) and len(eager.eval_losses) >= 2
    for s in eager.eval_losses:
        assert default.eval_losses[s] == pytest.approx(eager.eval_losses[s], abs=5e-3), s
    assert default.sample, "no sample after the graphed steps"


@pytest.mark.parametrize("world,overrides,expected", [
    (2, ["parallel.tp=2"], []),
    (2, ["parallel.tp=2", "parallel.tp_comm_overlap=true"], []),
    (2, ["parallel.tp=2", "parallel.tp_comm_overlap=true", "parallel.tp_overlap_impl=symmetric"], []),
    (4, ["parallel.tp=2", "parallel.cp=2", "parallel.dp_shard=ddp", "train.cuda_graph_warmup=11"], []),
    (2, ["parallel.dp=2", "parallel.dp_shard=fsdp"], ["not FSDP2 over dp x cp = 2 ranks"]),
    (2, ["parallel.cp=2"], ["not FSDP2 over dp x cp = 2 ranks"]),  # cp's ranks share the data-parallel wrapper
    (2, ["parallel.tp=2", "model.dropout=0.1"], ["not dropout (model.dropout=0.1"]),
    (4, ["parallel.pp=2", "parallel.dp=2", "parallel.dp_shard=ddp", "parallel.zero1=true"],
     ["not parallel.pp=2", "not parallel.zero1"]),
    (2, ["parallel.dp=2", "parallel.dp_shard=ddp"], ["needs train.cuda_graph_warmup >= 11, got 3"]),
])
def test_parallel_cuda_graph_layouts(world, overrides, expected):
    """Which layouts a CUDA-graph step may capture over several ranks, and the reason named for the others."""
    from megakern.train import parallel_graph_problems

    config = load_config(None, ["train.cuda_graph=true", *overrides])
    problems = parallel_graph_problems(config, world)
    assert len(problems) == len(expected), problems
    for problem, text in zip(problems, expected):
        assert text in problem, problems
    assert parallel_graph_problems(load_config(None, overrides), world) == []  # no graph asked


def test_graph_replay_wait_names_a_stalled_rank():
    """A replay over several ranks is waited for with a deadline (captured collectives are not watched by NCCL's
    watchdog): a step that never finishes raises instead of hanging."""
    from megakern.train import StepFigures, wait_for_event

    class Never:
        def query(self):
            return False

    with pytest.raises(RuntimeError, match=r"step 7: the replayed CUDA graph has not finished after 0.05 s"):
        StepFigures(7, torch.zeros(3), Never(), timeout=0.05).read()

    class Soon:
        calls = 0

        def query(self):
            self.calls += 1
            return self.calls > 3

    wait_for_event(Soon(), 5.0, "step 1")


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, data_cache) -> dict[str, str | None]:
    """tests/train/parallel_refusal_probe.py on 2 gloo ranks (torchrun), one launch for every refusal of a run over
    ranks: {case: the ConfigError's message, or None where the trainer started}."""
    tmp = tmp_path_factory.mktemp("refusals")
    cases = {"cuda-graph-on-cpu": ["parallel.tp=2", "train.cuda_graph=true"],
             "bf16-fsdp-params-in-fp32": ["train.steps=1", "train.precision=fp32", "parallel.dp=2",
                                          "parallel.fsdp_param_dtype=bfloat16"]}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(REPO / "tests" / "train" / "parallel_refusal_probe.py"), *TINY, "train.device=cpu",
           f"data.cache_dir={data_cache}"]
    for name, overrides in cases.items():
        cmd += ["--case", name, *overrides, f"log.run_dir={tmp / name}"]
    proc = launch(cmd, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = {r["case"]: r["refused"] for r in map(json.loads, (line for line in proc.stdout.splitlines()
                                                                 if line.startswith("{")))}
    assert sorted(out) == sorted(cases), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_parallel_cuda_graph_on_cpu_ranks_is_refused(refusals):
    """tp2 over 2 gloo ranks with train.cuda_graph: the layout may be captured, the device may not."""
    refused = refusals["cuda-graph-on-cpu"]
    assert refused is not None, "the trainer started"
    assert "train.cuda_graph needs a CUDA device (train.device is cpu)" in refused, refused


def test_ranks_refuse_bf16_fsdp_parameters_without_autocast(refusals):
    refused = refusals["bf16-fsdp-params-in-fp32"]
    assert refused is not None, "the trainer started"
    assert "parallel.fsdp_param_dtype=bfloat16 computes the blocks in bf16" in refused, refused


@pytest.mark.gpu
def test_gpu_profile_has_kernels(tmp_path, data_cache):
    t = trainer(tmp_path, data_cache, *TINY, *GPU, f"log.profile_dir={tmp_path / 'profiles'}", profile=True)
    out = Path(t.run().profile_dir)
    table = (out / "kernels.txt").read_text()
    assert "Self CUDA" in table and "forward" in table
    # the timeline of the recorded steps: its parts add up to the GPU wall time
    steps = _timeline.analyze(_timeline.load(out / "trace.json"))
    assert len(steps) == t.config.log.profile_active and all(s.kernels > 0 for s in steps)
    for s in steps:
        parts = s.compute_alone + s.overlapped + s.comm_exposed + s.idle_host + s.idle_other
        assert parts == pytest.approx(s.wall, rel=1e-6) and s.comm_busy == 0
    assert "# timeline per step" in (out / "timeline.txt").read_text() and "# timeline per step" in table


def test_profile_waits_past_the_graph_capture():
    """With a CUDA-graph step the profiler records replays: its wait covers the eager steps and the capture."""
    from megakern.train.profile import past_capture

    lg = load_config(None, []).log
    assert past_capture(lg, None) == (lg, None)
    waited, note = past_capture(lg, 3)
    assert (waited.profile_wait, waited.profile_warmup, waited.profile_active) == (4, lg.profile_warmup,
                                                                                  lg.profile_active)
    assert note == ("profile: waits 4 steps (log.profile_wait is 1), past the 3 eager steps and the capture of the "
                    "CUDA-graph step: it records replays")
    long_wait = load_config(None, ["log.profile_wait=5"]).log
    assert past_capture(long_wait, 3) == (long_wait, None)


@pytest.mark.gpu
def test_gpu_profile_of_the_default_graph_step(tmp_path, data_cache):
    """The default run on a GPU is a CUDA-graph step: --profile records replays, after the capture."""
    t = trainer(tmp_path, data_cache, *TINY, "train.device=cuda", f"log.profile_dir={tmp_path / 'profiles'}",
                profile=True)
    out = Path(t.run().profile_dir)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "profile: waits 4 steps" in log and "step 4: captured the training step in a CUDA graph" in log
    steps = _timeline.analyze(_timeline.load(out / "trace.json"))
    assert len(steps) == t.config.log.profile_active and all(s.kernels > 0 for s in steps)


def _logged_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_records(run_dir) if "train/loss" in r}


def test_two_ranks_match_one_process_and_resume_in_one(tmp_path, data_cache):
    """torchrun, 2 CPU ranks (gloo), FSDP over dp=2 through megakern.parallel: the same losses as one process on the
    same global batch; its checkpoint (written by both ranks) resumes in one process with the same losses, and
    megakern-export writes it (on the CPU, no process group) as the Hugging Face model the one process's checkpoint
    of the same step becomes."""
    pytest.importorskip("megakern.parallel")
    common = [*TINY, "train.micro_batch_size=4", "train.global_batch_size=8", "eval.every=0",
              f"data.cache_dir={data_cache}"]
    single = trainer(tmp_path, data_cache, *common, "train.steps=5", "checkpoint.every=3", name="single").run()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "megakern.train", *common, "train.steps=3", "parallel.dp=2", "parallel.dp_shard=fsdp",
           f"log.run_dir={tmp_path / 'ranks'}"]
    proc = launch(cmd, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks (tp 1, pp 1, cp 1, dp 2)" in proc.stdout
    ranks = _logged_losses(tmp_path / "ranks")
    assert sorted(ranks) == [1, 2, 3]
    for step, loss in ranks.items():
        assert loss == pytest.approx(single.losses[step], abs=1e-5)
    ckpt = tmp_path / "ranks" / "checkpoints" / "step_00000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {"rng-rank00000.pt", "rng-rank00001.pt"} <= set(manifest["files"])
    resumed = trainer(tmp_path, data_cache, *common, "train.steps=5", f"checkpoint.resume={ckpt}",
                      "schedule.on_resume=config", name="resumed").run()  # (the 3-step run's schedule ends at 3)
    assert sorted(resumed.losses) == [4, 5]
    for step in (4, 5):
        assert resumed.losses[step] == pytest.approx(single.losses[step], abs=1e-5)
    if importlib.util.find_spec("transformers") and importlib.util.find_spec("safetensors"):
        from transformers import AutoModelForCausalLM

        from megakern.models.export import main as export

        outs = []
        for name, step_dir in (("ranks", ckpt), ("single", tmp_path / "single" / "checkpoints" / "step_00000003")):
            assert export([str(step_dir), str(tmp_path / f"hf-{name}")]) == 0
            outs.append(AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{name}").eval())
        idx = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(outs[0](idx).logits, outs[1](idx).logits, rtol=0, atol=1e-4)


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["megakern-train"] == "megakern.train:main"
    assert project["scripts"]["megakern-export"] == "megakern.models.export:main"
    assert project["scripts"]["megakern-generate"] == "megakern.models.generate_cli:main"


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="Write tests/train/golden_gpt_tiny.json")
    parser.add_argument("--write-golden", action="store_true", required=True)
    parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        losses = golden_run(Path(tmp) / "run", Path(tmp) / "data")
    GOLDEN.write_text(json.dumps({"config": "configs/gpt-tiny.yaml", "steps": GOLDEN_STEPS, "device": "cpu",
                                  "precision": "fp32", "corpus": default_corpus_id(), "torch": torch.__version__,
                                  "losses": losses}, indent=1) + "\n")
    print(f"wrote {GOLDEN}: {losses}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_optimizer_clips_through_grad_scale(tmp_path, data_cache, precision):
    """With fused AdamW the clipping coefficient is the optimizer's grad_scale (a divisor applied as it reads the
    gradients) instead of a pass over them: the same trajectory as clip_grad_norm_ + foreach AdamW, and the divisor
    really clips (> 1 with a small train.grad_clip)."""
    common = [*TINY, "train.steps=4", "eval.every=0", "checkpoint.every=0", "checkpoint.final=false",
              "train.grad_clip=0.05", f"train.precision={precision}"]
    fused = trainer(tmp_path, data_cache, *common, "optim.fused=fused", name="fused")
    assert fused.stepper.device_skip
    divisors = []
    step = fused.stepper.device_step

    def spy(figures):
        divisors.append(float(fused.stepper.clip_divisor))
        return step(figures)

    fused.stepper.device_step = spy
    got = fused.run().losses
    want = trainer(tmp_path, data_cache, *common, "optim.fused=foreach", name="foreach").run().losses
    assert divisors and all(d > 1.0 for d in divisors), divisors
    for s in want:
        assert got[s] == pytest.approx(want[s], abs=1e-4), s


@pytest.mark.parametrize("accum", [1, 2])
def test_megakern_master_step_trains_as_torch_fused(tmp_path, data_cache, accum):
    """bf16 weights with fp32 masters: megakern's one-pass master AdamW (bf16 gradients read directly with one
    micro-batch a step, the fp32 master gradients with two) follows torch's fused AdamW + the copies, clipping
    included; the bf16 weights are the masters rounded."""
    from conftest import require_triton

    require_triton(torch.device("cpu"))
    common = [*TINY, "train.steps=4", "eval.every=0", "checkpoint.every=0", "checkpoint.final=false",
              "train.grad_clip=0.05", "train.precision=bf16", f"train.global_batch_size={8 * accum}"]
    ours = trainer(tmp_path, data_cache, *common, "optim.fused=megakern", name="megakern")
    assert ours.stepper.master_step is not None and ours.stepper.device_skip
    got = ours.run().losses
    want = trainer(tmp_path, data_cache, *common, "optim.fused=fused", name="fused").run().losses
    for s in want:  # the same update in fp32 (divisions by the clipping divisor as multiplications: an ulp apart)
        assert got[s] == pytest.approx(want[s], abs=2e-4), s
    for p, m in ours.stepper.masters.items():
        assert torch.equal(p, m.to(p.dtype))  # the bf16 weights are the masters rounded to nearest even
    assert {int(s["step"]) for s in ours.stepper.optimizer.state.values()} == {4}


def test_megakern_master_step_needs_bf16_weights(tmp_path, data_cache):
    with pytest.raises(ConfigError, match="optim.fused=megakern .* needs train.precision=bf16"):
        trainer(tmp_path, data_cache, *TINY, "optim.fused=megakern", "train.precision=fp32")
