"""Training throughput across parallel layouts: the training program (megakern-train) under torchrun, one run per
layout (tensor, pipeline, context and data parallel, and their combinations), against the same model on one GPU.

Each layout runs ``python -m torch.distributed.run -m megakern.train`` (one plain process for the one-GPU baseline)
with the model preset, bf16 autocast, micro-batch ``--micro-batch`` per data-parallel rank, warm-up steps and timed
steps, no eval, checkpoint or sample; its figures come from the run's own train.log (rank 0's JSON lines):

- ms: the median step time over the timed steps (the trainer's wall time between consecutive steps);
- tok/s: tokens per step (micro-batch x sequence x data-parallel ranks x accumulation) / step time; tok/s/gpu;
- MFU: GPT.flops_per_token(seq) x tok/s / GPUs / the GPU's dense bf16 peak (megakern.train.log.PEAK_BF16_FLOPS);
- GiB: rank 0's peak allocated memory; loss: the last step's (a sanity check, not compared);
- scaling: tok/s/gpu over the one-GPU run's (weak scaling: each data-parallel rank keeps the micro-batch).

Pipeline layouts accumulate ``--pp-microbatches`` micro-batches per step (a pipeline needs several to fill; its
bubble is (pp - 1) / (m + pp - 1)); the others take one micro-batch per step, the one-GPU baseline too.

Communication hidden behind compute (``--overlap``), for pure data-parallel layouts: the gradient collectives of one
step are timed alone (NCCL on the same GPUs, same bytes: DDP all-reduces the fp32 gradients; FSDP all-gathers the fp32
parameters in forward and again in backward and reduce-scatters the gradients), and
hidden = 1 - (step(dp) - step(one GPU)) / collectives, clipped to [0, 1]: the share of the collectives' time that
the data-parallel step does not add to the one-GPU step. When the layouts include "1xK" for the same number of GPUs
(K one-GPU runs at once), that is the reference instead: it shares the host the same way, without communication.

For an expert-parallel layout ("dp2.ep2-ddp": ep carved out of the dp x cp ranks, no GPUs of its own): the expert
dispatch's all-to-alls of one step (dispatch and combine of every MoE block, forward and backward: a rank's routed
rows, micro-batch x T / cp x top-k rows of C (with model.moe_capacity_factor the fixed slots, E x capacity rows), in
equal splits over ep ranks) are timed alone, and hidden = 1 -
(step(layout) - step(the same layout without ep)) / those all-to-alls (the one-GPU step when that layout was not
measured), clipped to [0, 1]. The layout without ep holds every expert on every rank; with ep the expert
gradients are reduced over the expert-data-parallel group only, so some of the difference is the smaller gradient
reduction: "hidden" there counts that saving too. An MoE run's line also gives its routing imbalance (the worst
layer's max / mean tokens per expert) and dropped share over the timed steps: an untrained router may send every
token of a layer to the same experts (imbalance E / top-k, its most: 4.00 for top-2 of 8), which with ep makes one rank
compute for all; `--override model.moe_force_balance=true` draws the experts evenly (a trained router's load).
``--override`` (repeatable) passes megakern-train overrides to every layout; they are named in the rows' case.

For a tensor-parallel layout with "-ovl" measured after the same layout without it: the row-parallel layers'
reduce-scatters (forward) and all-gathers (backward) of one step (with "-symm" the column layers' too) are timed
alone, and
hidden = (step(layout) - step(layout-ovl)) / those collectives, clipped to [0, 1].

Layouts are written as factors: "1", "dp2", "dp2-ddp", "tp2", "pp2", "cp2", "tp2.dp2", "tp2.pp2", "dp4-ddp-zero1", ...
(dp defaults to FSDP; "-ovl" overlaps the row-parallel layers' reduce-scatter with their matmuls, e.g. "tp2-ovl",
"-ovl-symm" both layers' collectives through symmetric memory (parallel.tp_overlap_impl=symmetric), "-ovl-symm-kern"
with the GEMM + reduce-scatter by the Triton tile-storing kernel (tp_overlap_impl=symmetric-kernel), "-pull" with the
kept all-gathers pulled (parallel.tp_overlap_gather=pull; default: pushed), "-pK" with
symm's reduce-scatter blocks in K runs of rows (parallel.tp_overlap_pieces, default 2), "-ksig" with symm's signals
by torch's kernels (parallel.tp_overlap_signals=kernel; default: stream writes); a last "-graph" captures the step
in a CUDA graph (train.cuda_graph) after the warm-up: "1-graph", "tp2-ovl-graph", "dp2-ddp-graph" (DDP: 11 eager
steps first), compared with "1-graph" and "1xK-graph"). The GPUs needed are the
product of the factors; layouts needing more than this machine has are skipped with a line saying so. "1xK" runs K
independent one-GPU trainings at once, one per GPU (ms: the slowest's step; tok/s: all K at that pace, as ranks in
lock step would go): no communication at all, so its scaling against "1" is what sharing the host costs (CPU, memory
bandwidth, driver), the ceiling of any K-GPU layout on this machine.

    python -m benchmarks.bench_parallel --model gpt-350m --layouts 1,dp2-ddp,dp2,tp2,pp2,cp2 --overlap
    python -m benchmarks.bench_parallel --model gpt-1.3b --micro-batch 4 --layouts 1,dp4,tp4,tp2.dp2
    python -m benchmarks.bench_parallel --tiny --device cpu --layouts 1,dp2,tp2     # smoke test (gloo ranks)
    python -m benchmarks.bench_parallel --layouts 1,dp2-ddp,tp2 --profile out/    # where the time goes, per layout
    python -m benchmarks.bench_parallel --layouts 1,1x2,1x4,dp2-ddp               # the host's share of the scaling
    python -m benchmarks.bench_parallel --layouts 1-graph,tp2-graph,tp2-ovl-graph,dp2-ddp-graph --overlap
    python -m benchmarks.bench_parallel --model moe-mixtral --layouts 1,dp2-ddp,dp2.ep2-ddp,dp4.ep4-ddp --overlap
    python -m benchmarks.bench_parallel --model moe-mixtral --override model.moe_force_balance=true \
        --override model.moe_capacity_factor=1.25 --layouts 1-graph,dp2.ep2-ddp-graph --overlap   # fixed-size dispatch

Environment of every run: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 (NVLink
multicast stays off), OMP_NUM_THREADS unless set: the cores shared out among the run's processes, at most 4 each
(on a CPU, more threads than cores made a gloo data-parallel step 15x slower).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__:
    from .common import RESULTS_DIR, Results, file_rows, run_launch
else:  # python benchmarks/bench_parallel.py
    from common import RESULTS_DIR, Results, file_rows, run_launch

BENCH = "parallel"
REPO = Path(__file__).resolve().parents[1]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Layout:
    spec: str
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallel: carved out of dp x cp (the ranks are the same), no extra GPUs
    dp_shard: str = "fsdp"
    zero1: bool = False
    tp_comm_overlap: bool = False  # "-ovl": the row-parallel reduce-scatter overlapped with the matmul (tp > 1)
    tp_overlap_impl: str = "ring"  # "-symm" (with -ovl): the row and column layers' ops through symmetric memory
    tp_overlap_pieces: int = 2  # "-pK" (with -symm): parallel.tp_overlap_pieces, each reduce-scatter block in K runs
    tp_overlap_signals: str = "stream"  # "-ksig" (with -symm): parallel.tp_overlap_signals=kernel
    tp_overlap_gather: str = "push"  # "-pull" (with -symm): parallel.tp_overlap_gather=pull
    copies: int = 1  # "1xK": K independent one-GPU runs at once (the host's own scaling, no communication)
    cuda_graph: bool = False  # "-graph": the step captured in a CUDA graph after the warm-up and replayed

    @property
    def ddp(self) -> bool:
        return self.dp_shard == "ddp" and self.dp * self.cp > 1

    def graph_warmup(self, warmup: int) -> int:
        """Eager steps before the capture: the capture is the last untimed step; DDP needs 11 (train.py)."""
        return 11 if self.ddp else max(warmup - 1, 1)

    def untimed(self, warmup: int) -> int:
        """Steps before the timed ones: the warm-up, or the graph's eager steps and its capture."""
        return max(warmup, self.graph_warmup(warmup) + 1) if self.cuda_graph else warmup

    @property
    def base(self) -> str:
        """The one-GPU layout this one is compared with: "1", or "1-graph" for a graphed layout."""
        return "1-graph" if self.cuda_graph else "1"

    @property
    def world(self) -> int:
        """Ranks of one run."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def gpus(self) -> int:
        return self.world * self.copies

    @classmethod
    def parse(cls, spec: str) -> "Layout":
        spec = spec.strip()
        graph = spec.endswith("-graph")
        bare = spec[:-len("-graph")] if graph else spec
        if bare == "1":
            return cls(spec, cuda_graph=graph)
        m = re.fullmatch(r"1x(\d+)", bare)
        if m:
            if int(m.group(1)) < 1:
                raise ValueError(f"bench_parallel: layout {spec!r}: 1xK needs K >= 1")
            return cls(spec, copies=int(m.group(1)), cuda_graph=graph)
        head, *flags = bare.split("-")
        sizes = {}
        for part in head.split("."):
            m = re.fullmatch(r"(tp|pp|cp|dp|ep)(\d+)", part)
            if not m or m.group(1) in sizes or int(m.group(2)) < 1:
                raise ValueError(f"bench_parallel: layout {spec!r}: each factor is tp|pp|cp|dp|ep and a size >= 1, "
                                 f"once (e.g. 'tp2.dp2', 'dp4-ddp-zero1', 'dp4.ep2-ddp'); bad part {part!r}")
            sizes[m.group(1)] = int(m.group(2))
        ep, dp_cp = sizes.get("ep", 1), sizes.get("dp", 1) * sizes.get("cp", 1)
        if dp_cp % ep:
            raise ValueError(f"bench_parallel: layout {spec!r}: ep={ep} is carved out of dp x cp = {dp_cp} ranks and "
                             f"must divide it")
        pieces = [f for f in flags if re.fullmatch(r"p\d+", f)]
        unknown = set(flags) - {"ddp", "fsdp", "zero1", "ovl", "symm", "kern", "ksig", "pull"} - set(pieces)
        if unknown:
            raise ValueError(f"bench_parallel: layout {spec!r}: unknown flag(s) {sorted(unknown)} (ddp, fsdp, zero1, "
                             f"ovl, symm, kern, ksig, pull, pK; and graph, last)")
        if pieces and ("symm" not in flags or len(pieces) > 1):
            raise ValueError(f"bench_parallel: layout {spec!r}: pK (once) cuts symm's reduce-scatter blocks in K runs; "
                             f"add '-symm'")
        if "symm" in flags and "ovl" not in flags:
            raise ValueError(f"bench_parallel: layout {spec!r}: symm picks the overlap's implementation; add '-ovl'")
        for flag, what in (("kern", "GEMM + reduce-scatter"), ("ksig", "signals"),
                           ("pull", "all-gather of the kept inputs")):
            if flag in flags and "symm" not in flags:
                raise ValueError(f"bench_parallel: layout {spec!r}: {flag} picks symm's {what}; add '-symm'")
        if "ovl" in flags and sizes.get("tp", 1) < 2:
            raise ValueError(f"bench_parallel: layout {spec!r}: ovl overlaps tensor parallelism's reduce-scatter; it "
                             f"needs tp >= 2")
        shard = "ddp" if "ddp" in flags else "fsdp"
        if "zero1" in flags and shard != "ddp":
            raise ValueError(f"bench_parallel: layout {spec!r}: zero1 shards the optimizer of DDP; add '-ddp'")
        return cls(spec, dp_shard=shard, zero1="zero1" in flags, tp_comm_overlap="ovl" in flags,
                   tp_overlap_impl=("symmetric-kernel" if "kern" in flags else "symmetric") if "symm" in flags
                   else "ring",
                   tp_overlap_pieces=int(pieces[0][1:]) if pieces else 2,
                   tp_overlap_signals="kernel" if "ksig" in flags else "stream",
                   tp_overlap_gather="pull" if "pull" in flags else "push", cuda_graph=graph, **sizes)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_env(processes: int) -> dict:
    """A training run's environment: NVLink multicast off; unless set, OMP_NUM_THREADS at each of the run's
    ``processes`` share of the cores, at most 4."""
    env = {**os.environ, **NO_MULTICAST}
    env.setdefault("OMP_NUM_THREADS", str(omp_threads(processes)))
    return env


def omp_threads(processes: int, cores: int | None = None) -> int:
    """Threads for each of ``processes`` processes at once: their share of the cores, at least 1, at most 4."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, min(4, cores // max(processes, 1)))


def run_layout(layout: Layout, args, run_dir: Path, data_cache: Path) -> tuple[dict, str]:
    """One training run; returns (figures from its train.log, its output tail)."""
    accum = args.pp_microbatches if layout.pp > 1 else 1
    overrides = [
        f"model.preset={args.model}", f"train.device={args.device}", f"train.precision={args.precision}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch * layout.dp * accum}",
        f"train.steps={layout.untimed(args.warmup) + args.steps}", "eval.every=0", "checkpoint.every=0",
        "checkpoint.final=false",
        "data.max_epochs=1000", "eval.batches=1", "train.sample_tokens=0", "log.progress=false",
        "log.tensorboard=false", "log.every=1000000",
        f"data.num_workers={args.data_workers}", f"data.cache_dir={data_cache}", f"log.run_dir={run_dir}",
        f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.cp={layout.cp}",
        f"parallel.dp={layout.dp}", f"parallel.ep={layout.ep}", f"parallel.dp_shard={layout.dp_shard}",
        f"parallel.zero1={str(layout.zero1).lower()}",
        f"parallel.tp_comm_overlap={str(layout.tp_comm_overlap).lower()}",
        f"parallel.tp_overlap_impl={layout.tp_overlap_impl}", f"parallel.tp_overlap_pieces={layout.tp_overlap_pieces}",
        f"parallel.tp_overlap_signals={layout.tp_overlap_signals}",
        f"parallel.tp_overlap_gather={layout.tp_overlap_gather}",
        *args.override,
    ]
    if layout.cuda_graph:
        overrides += ["train.cuda_graph=true", f"train.cuda_graph_warmup={layout.graph_warmup(args.warmup)}"]
    else:  # eager steps, as the layout names them (train.cuda_graph's default 'auto' would capture where it can)
        overrides += ["train.cuda_graph=false"]
    if args.profile:  # the profiler's wait + warm-up + 3 recorded steps instead of the timed steps
        overrides += [f"log.profile_dir={run_dir / 'profile'}",
                      f"log.profile_wait={max(layout.untimed(args.warmup) - 1, 1)}",
                      "log.profile_warmup=1", "log.profile_active=3", "--profile"]
    if layout.copies > 1:
        return _run_copies(layout, args, run_dir, overrides)
    if layout.world == 1:
        cmd = [sys.executable, "-m", "megakern.train", *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(layout.world),
               "--master-port", str(free_port()), "-m", "megakern.train", *overrides]
    env = _run_env(layout.world)
    start = time.perf_counter()
    try:
        proc = run_launch(cmd, timeout=args.timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as exc:  # what the run printed before it was stopped: where it hung
        raise RuntimeError(f"no exit within {args.timeout:g} s (--timeout);{_log_text_tail(run_dir)} the run's last "
                           f"output:\n{exc.stdout[-2000:]}{exc.stderr[-4000:]}".strip()) from None
    wall = time.perf_counter() - start
    tail = (proc.stdout[-2000:] + proc.stderr[-4000:]).strip()
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode} after {wall:.0f} s;{_log_text_tail(run_dir)} the run's last "
                           f"output:\n{tail}")
    if args.profile:
        # one directory per rank (…-rank<r> under torchrun): rank 0's tables, then every other rank's timeline
        tables = sorted((run_dir / "profile").glob("*/kernels.txt"),
                        key=lambda t: (not t.parent.name.endswith("-rank0"), t.parent.name))
        if not tables:
            raise RuntimeError(f"no profile written under {run_dir / 'profile'}:\n{tail}")
        args.profile.mkdir(parents=True, exist_ok=True)
        dest = args.profile / f"{args.model}_{layout.spec}_kernels.txt"
        text = tables[0].read_text()
        for t in tables[1:]:
            if (t.parent / "timeline.txt").exists():
                text += f"\n\n# {t.parent.name}\n" + (t.parent / "timeline.txt").read_text()
        dest.write_text(text)
        for t in tables:  # every rank's trace, compressed (chrome://tracing and ui.perfetto.dev read them as they are)
            trace = t.parent / "trace.json"
            rank = re.search(r"-rank(\d+)$", t.parent.name)
            suffix = "" if rank is None or rank[1] == "0" else f"_rank{rank[1]}"
            if trace.exists():
                with trace.open("rb") as src, gzip.open(
                        args.profile / f"{args.model}_{layout.spec}_trace{suffix}.json.gz", "wb") as out:
                    shutil.copyfileobj(src, out)
        return {"profile": dest}, tail
    return _figures(run_dir, layout.untimed(args.warmup), args.micro_batch * layout.dp * accum * args.seq, wall,
                    accum), tail


def _log_text_tail(run_dir: Path, lines: int = 20) -> str:
    """The last ``lines`` text lines of a run's train.log, as a block to quote in a failure's message (the step
    watchdog's verdict and a rank's error land there, while torchrun's own report fills the output's tail); "" when
    the run wrote none."""
    try:
        text = [line for line in (run_dir / "train.log").read_text(errors="replace").splitlines()
                if line.strip() and not line.startswith("{")]
    except OSError:
        return ""
    return " its train.log ends:\n" + "\n".join(text[-lines:]) + "\n" if text else ""


def _figures(run_dir: Path, untimed: int, tokens: int, wall: float, accum: int) -> dict:
    """The figures of one run's steps after the first ``untimed``, from its train.log."""
    from megakern.train.log import read_records

    steps = {r["step"]: r for r in read_records(run_dir) if "perf/step_ms" in r}
    timed = [steps[s]["perf/step_ms"] for s in sorted(steps) if s > untimed]
    if not timed:
        raise RuntimeError(f"no timed steps in {run_dir / 'train.log'} (steps logged: {sorted(steps)})")
    last = steps[max(steps)]
    ms = statistics.median(timed)
    out = {"ms": ms, "tok/s": tokens / (ms / 1e3), "GiB": max(r.get("perf/memory_gib", 0.0) for r in steps.values()),
           "loss": last["train/loss"], "wall": wall, "accum": accum}
    # an MoE model's routing over the timed steps: the worst layer's max / mean tokens per expert, the share dropped
    for key, name in (("moe/imbalance", "moe imbalance"), ("moe/dropped", "moe dropped")):
        values = [steps[s][key] for s in sorted(steps) if s > untimed and key in steps[s]]
        if values:
            out[name] = statistics.mean(values)
    return out


def _run_copies(layout: Layout, args, run_dir: Path, overrides: list[str]) -> tuple[dict, str]:
    """``layout.copies`` one-GPU runs at once, copy i on GPU i: the step time of the slowest copy (ms) and the
    tokens/s of all together at that pace. Against layout "1" this is what the host alone costs data parallelism."""
    procs, start = [], time.perf_counter()
    for i in range(layout.copies):
        env = _run_env(layout.copies * layout.world)
        if args.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        cmd = [sys.executable, "-m", "megakern.train",
               *[o for o in overrides if not o.startswith("log.run_dir=")], f"log.run_dir={run_dir / str(i)}"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(args.timeout - (time.perf_counter() - start), 1))[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    wall = time.perf_counter() - start
    tail = outs[-1][-2000:].strip() if outs else ""
    bad = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    if bad:
        raise RuntimeError(f"copy {bad[0]} exited {procs[bad[0]].returncode} after {wall:.0f} s:\n"
                           f"{outs[bad[0]][-3000:].strip()}")
    each = [_figures(run_dir / str(i), layout.untimed(args.warmup), args.micro_batch * args.seq, wall, 1)
            for i in range(layout.copies)]
    ms = max(f["ms"] for f in each)  # the slowest copy: what ranks in lock step (every collective) would see
    return {"ms": ms, "tok/s": layout.copies * args.micro_batch * args.seq / (ms / 1e3),
            "GiB": max(f["GiB"] for f in each), "loss": each[0]["loss"], "wall": wall, "accum": 1}, tail


def moe_facts(preset: str, overrides: list[str] = ()) -> tuple[int, int, float | None, int]:
    """(top-k, MoE blocks, capacity factor or None, experts) of the preset with the ``model.moe_*`` ones of
    ``overrides``; (0, 0, None, 0) for a dense model."""
    from megakern.config import load_config

    config = load_config(None, [f"model.preset={preset}", *[o for o in overrides if o.startswith("model.")]]).model
    if not config.n_experts:
        return 0, 0, None, 0
    return config.moe_top_k, len(config.moe_blocks), config.moe_capacity_factor, config.n_experts


def routed_rows(tokens: int, moe: tuple[int, int, float | None, int]) -> int:
    """Rows a rank sends in each expert all-to-all for ``tokens`` tokens: tokens x top-k (dropless), or with a
    capacity factor the fixed slots, E x ceil(factor x tokens x top-k / E) (the empty ones travel too)."""
    top_k, _, factor, experts = moe
    if factor is None:
        return tokens * top_k
    return experts * math.ceil(factor * tokens * top_k / experts)


def model_facts(preset: str) -> tuple[float, int, int, int, int]:
    """(training FLOPs per token, parameters, sequence length, layers, hidden size) of the preset, built on the meta
    device."""
    from megakern.models.gpt import GPT, GPTConfig

    config = GPTConfig.preset(preset)
    with torch.device("meta"):
        model = GPT(config)
    return (model.flops_per_token(config.max_seqlen), model.num_params(), config.max_seqlen, config.n_layer,
            config.n_embd)


# ---- the collectives alone (--overlap) -------------------------------------------------------------------------
def _collective_worker(numel: int, kind: str, reps: int, device_type: str, count: int = 1,
                       dtype: str = "float32") -> None:
    """Run under torchrun: time one step's collectives, on the GPUs (NCCL) or the CPUs (gloo) as the benchmark's runs;
    rank 0 prints one JSON line {"ms": median}. Data parallel ("all_reduce", "fsdp"): ``numel`` fp32 values.
    Sequence parallel's row-parallel pair ("sp_rs_ag"): ``count`` reduce-scatters and as many all-gathers of
    ``numel`` values of ``dtype`` each (the full tensor's size): what tp_comm_overlap hides. Expert parallel's
    dispatch ("all_to_all"): ``count`` all_to_all_single of a rank's ``numel`` values of ``dtype``, in equal splits
    (a balanced router's exchange)."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    world, device = dist.get_world_size(), torch.device("cuda", local) if cuda else torch.device("cpu")
    shard = -(-numel // world)
    full = torch.randn(shard * world, device=device).to(getattr(torch, dtype))
    part = torch.empty(shard, device=device, dtype=full.dtype)

    def step():
        if kind == "all_to_all":
            for _ in range(count):
                dist.all_to_all_single(part.new_empty(full.shape), full)
        elif kind == "sp_rs_ag":  # forward's reduce-scatters, backward's all-gathers
            for _ in range(count):
                dist.reduce_scatter_tensor(part, full)
            for _ in range(count):
                dist.all_gather_into_tensor(full, part)
        elif kind == "all_reduce":
            dist.all_reduce(full)
        else:  # FSDP: all-gather in forward and in backward, reduce-scatter of the gradients
            dist.all_gather_into_tensor(full, part)
            dist.all_gather_into_tensor(full, part)
            dist.reduce_scatter_tensor(part, full)

    times = []
    for i in range(reps + 3):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    if dist.get_rank() == 0:
        print(json.dumps({"ms": statistics.median(times)}))
    dist.destroy_process_group()


def collective_ms(world: int, numel: int, kind: str, timeout: float, device_type: str, tries: int = 2,
                  count: int = 1, dtype: str = "float32") -> float:
    """Median ms of one step's data-parallel collectives, timed by a torchrun of ``world`` workers. A failed launch
    is tried again on a new port (the free port found may be taken by a concurrent run before torchrun binds it)."""
    env = _run_env(world)
    for attempt in range(tries):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
               str(free_port()), "-m", "benchmarks.bench_parallel", "--collective-worker", kind, "--numel",
               str(numel), "--count", str(count), "--dtype", dtype, "--device", device_type]
        proc = run_launch(cmd, timeout=timeout, cwd=REPO, env=env)
        if proc.returncode == 0:
            return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])["ms"]
    raise RuntimeError(f"collective {kind} x{world}: exit {proc.returncode} ({tries} tries)\n{proc.stderr[-3000:]}")


# ---- main ----------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-350m", help="model preset (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="gpt-tiny, 2 + 3 steps, fp32: a smoke test of the machinery")
    p.add_argument("--layouts", default="1,dp2-ddp,dp2,tp2,pp2,cp2",
                   help="comma-separated layouts (default: %(default)s)")
    p.add_argument("--micro-batch", type=int, default=8, help="micro-batch per data-parallel rank (default: 8)")
    p.add_argument("--pp-microbatches", type=int, default=8, help="micro-batches per step of pipeline layouts")
    p.add_argument("--warmup", type=int, default=4, help="steps not timed (compilation, allocator warm-up)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default=None, help="train.precision (default: bf16-autocast on GPUs, fp32 on CPU)")
    p.add_argument("--data-workers", type=int, default=2)
    p.add_argument("--overlap", action="store_true", help="time the data-parallel collectives alone too")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--override", action="append", default=[], help="extra megakern-train override (repeatable)")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="profile each layout instead (megakern-train --profile: 3 steps under torch.profiler) and "
                        "copy rank 0's kernel and host tables to DIR/<model>_<layout>_kernels.txt, its trace to "
                        "DIR/<model>_<layout>_trace.json.gz and rank r's to ..._trace_rank<r>.json.gz; no figures")
    p.add_argument("--out", type=Path, default=None,
                   help=f"results root (default: {RESULTS_DIR} for GPU runs and --from-log; a CPU run files no rows "
                        "without it)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--from-log", type=Path, metavar="LOG",
                   help="save the rows of an earlier run from its printed log (when its CSV did not come back), as "
                        "printed (ms to 0.1, MFU to 0.1%%); --meta gives the run's stamp")
    p.add_argument("--meta", metavar="DATE,SHA,GPU,TORCH,TRITON",
                   help="with --from-log: the run's UTC date, git sha, gpu slug, torch and triton versions")
    p.add_argument("--collective-worker", choices=["all_reduce", "fsdp", "sp_rs_ag", "all_to_all"],
                   help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.warmup, args.steps, args.micro_batch, args.pp_microbatches = "gpt-tiny", 2, 3, 2, 2
    if args.precision is None:
        args.precision = "bf16-autocast" if args.device.startswith("cuda") else "fp32"
    return args


_HEAD = re.compile(r"^(?P<case>\S+ T\d+ mb\d+ \S+): .* per run$")
_LAYOUT = re.compile(r"^(?P<spec>\S+)\s+(?P<gpus>\d+) x\s+(?P<ms>[\d.]+) ms\s+(?P<toks>[\d.]+) tok/s\s+(?P<tpg>[\d.]+) "
                     r"tok/s/gpu MFU (?P<mfu>[\d.]+%|n/a) (?P<gib>[\d.]+) GiB(?: scaling (?P<scaling>[\d.]+))? "
                     r"\(accum \d+, loss (?P<loss>[\d.]+|nan)")
_COMM = re.compile(r"^\s+(?:collectives alone|row-parallel reduce-scatters|expert all-to-alls).* (?P<comm>[\d.]+) "
                   r"ms; .*: (?P<hidden>\d+)% hidden$")


def rows_from_log(text: str) -> list[tuple[str, str, str, str, float]]:
    """The figures an earlier run printed (its layout and communication lines), as Results figures."""
    rows, case, spec = [], None, None
    for line in text.splitlines():
        if m := _HEAD.match(line):
            case = m["case"]
        elif case and (m := _LAYOUT.match(line)):
            spec = m["spec"]
            figs = {"ms": m["ms"], "tok/s": m["toks"], "tok/s/gpu": m["tpg"], "GiB": m["gib"],
                    "scaling": m["scaling"], "loss": m["loss"],
                    "MFU": None if m["mfu"] == "n/a" else float(m["mfu"][:-1]) / 100}
            rows += [(case, spec, "megakern", k, float(v)) for k, v in figs.items() if v is not None]
        elif case and spec and (m := _COMM.match(line)):
            rows += [(case, spec, "megakern", "comm ms", float(m["comm"])),
                     (case, spec, "megakern", "comm hidden", int(m["hidden"]) / 100)]
    # the layout lines in rows' usual metric order (ms, tok/s, tok/s/gpu, MFU, GiB, scaling, loss)
    order = ("ms", "tok/s", "tok/s/gpu", "MFU", "GiB", "scaling", "loss", "comm ms", "comm hidden")
    key = {(c, s): i for i, (c, s, *_) in reversed(list(enumerate(rows)))}
    return sorted(rows, key=lambda r: (key[r[0], r[1]], order.index(r[3])))


def save_from_log(log: Path, meta: str | None, out: Path) -> Path:
    fields = (meta or "").split(",")
    if len(fields) != 5 or not all(fields):
        raise SystemExit("bench_parallel: --from-log needs --meta DATE,SHA,GPU,TORCH,TRITON (the run's stamp)")
    rows = rows_from_log(log.read_text())
    if not rows:
        raise SystemExit(f"bench_parallel: no layout lines in {log}")
    results = Results(torch.device("cpu"))
    date, results.meta["git_sha"], results.meta["gpu"], results.meta["torch"], results.meta["triton"] = fields
    for row in rows:
        results.add(*row)
    return results.save(BENCH, out, date=date)


def available_gpus(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.device_count()
    return os.cpu_count() or 1  # gloo ranks on CPU


def main(argv=None) -> Results | None:
    args = parse_args(argv)
    if args.from_log:
        print(f"saved {save_from_log(args.from_log, args.meta, args.out or RESULTS_DIR)}")
        return None
    if args.collective_worker:
        _collective_worker(args.numel, args.collective_worker, reps=10, device_type=torch.device(args.device).type,
                           count=args.count, dtype=args.dtype)
        return None
    # `timeout`: leave through the finally below (the caller's handler is back afterwards)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args) -> Results:
    layouts = [Layout.parse(s) for s in args.layouts.split(",") if s.strip()]
    flops_per_token, params, args.seq, n_layer, n_embd = model_facts(args.model)
    moe = moe_facts(args.model, args.override)
    device = torch.device(args.device)
    from megakern.train.log import peak_flops

    peak, peak_note = peak_flops(device)
    have = available_gpus(args.device)
    results = Results(device)
    # the overrides (e.g. model.moe_capacity_factor=1.25) name the case: their rows are not the plain model's
    case = f"{args.model} T{args.seq} mb{args.micro_batch} {args.precision}" + (
        f"[{';'.join(args.override)}]" if args.override else "")
    print(f"{case}: {params / 1e6:.0f}M parameters, {flops_per_token / 1e9:.2f} GFLOP per token; peak "
          f"{'n/a (' + peak_note + ')' if peak is None else f'{peak / 1e12:.1f} TFLOP/s'}; {have} "
          f"{'GPUs' if device.type == 'cuda' else 'CPUs'}; {args.warmup} warm-up + {args.steps} timed steps per run")
    tmp = Path(tempfile.mkdtemp(prefix="bench_parallel-"))
    data_cache = tmp / "data"
    figures: dict[str, dict] = {}
    try:
        for layout in layouts:
            if layout.gpus > have:
                print(f"{layout.spec:<16} skipped: needs {layout.gpus} devices, this machine has {have}")
                continue
            try:
                f, _ = run_layout(layout, args, tmp / layout.spec, data_cache)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"{layout.spec:<16} FAILED: {e}")
                continue
            if args.profile:
                text = f["profile"].read_text().splitlines()
                summary = [line for line in text if line.startswith("#")]  # header, per-step timelines of each rank
                print(f"{layout.spec:<16} profile (rank 0 tables): {f['profile']}\n" + "\n".join(summary), flush=True)
                continue
            f["tok/s/gpu"] = f["tok/s"] / layout.gpus
            f["MFU"] = flops_per_token * f["tok/s"] / layout.gpus / peak if peak else None
            figures[layout.spec] = f
            base = figures.get(layout.base)
            f["scaling"] = f["tok/s/gpu"] / base["tok/s/gpu"] if base else None
            for metric in ("ms", "tok/s", "tok/s/gpu", "MFU", "GiB", "scaling", "loss", "moe imbalance",
                           "moe dropped"):
                if f.get(metric) is not None:
                    results.add(case, layout.spec, "megakern", metric, f[metric])
            mfu = "n/a" if f["MFU"] is None else f"{100 * f['MFU']:.1f}%"
            scaling = "" if f["scaling"] is None else f" scaling {f['scaling']:.2f}"
            routing = (f", routing imbalance {f['moe imbalance']:.2f}, dropped {100 * f['moe dropped']:.1f}%"
                       if "moe imbalance" in f and "moe dropped" in f else "")
            print(f"{layout.spec:<16} {layout.gpus} x {f['ms']:8.1f} ms {f['tok/s']:10.0f} tok/s "
                  f"{f['tok/s/gpu']:9.0f} tok/s/gpu MFU {mfu} {f['GiB']:.1f} GiB{scaling} (accum {f['accum']}, "
                  f"loss {f['loss']:.3f}, run {f['wall']:.0f} s{routing})", flush=True)
            if args.overlap:
                _communication(layout, args, device, f, figures, results, case, params, moe,
                               (n_layer, n_embd))
    finally:  # the layouts measured so far are reported and saved, also when a time limit stops the run (SIGTERM)
        shutil.rmtree(tmp, ignore_errors=True)
        print()
        for metric in ("tok/s/gpu", "MFU", "scaling", "GiB", "comm hidden"):
            if any(m == metric for *_, m, _ in results.figures):
                print(results.markdown(metric))
                print()
        if results.figures:
            file_rows(results, BENCH, args.out, args.no_save)
    return results


def _comm_alone(layout: Layout, args, device, world: int, numel: int, kind: str, count: int = 1,
                dtype: str = "float32") -> float | None:
    """collective_ms, or None after printing why it failed."""
    try:
        return collective_ms(world, numel, kind, args.timeout, device.type, count=count, dtype=dtype)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"{layout.spec:<16} collectives FAILED: {e}")
        return None


def _hidden_share(step_ms: float, ref_ms: float, comm: float) -> tuple[float, float]:
    """(ms the step adds over the reference, the share of ``comm`` it hides) = (exposed, 1 - exposed / comm)."""
    exposed = max(step_ms - ref_ms, 0.0)
    return exposed, (min(max(1.0 - exposed / comm, 0.0), 1.0) if comm > 0 else 1.0)


def _communication(layout: Layout, args, device, f: dict, figures: dict, results: Results, case: str, params: int,
                   moe: tuple, shape: tuple[int, int]) -> None:
    """--overlap: the layout's communication timed alone and the share its step hides (the module docstring)."""
    (_, moe_blocks, _, _), (n_layer, n_embd) = moe, shape
    dtype = "bfloat16" if args.precision == "bf16-autocast" else "float32"
    accum = args.pp_microbatches if layout.pp > 1 else 1
    measured = []  # (comm ms, hidden share, the line printed)
    if layout.dp > 1 and layout.world == layout.dp and layout.base in figures:
        kind = "all_reduce" if layout.dp_shard == "ddp" else "fsdp"
        if (comm := _comm_alone(layout, args, device, layout.world, params, kind)) is not None:
            # against K one-GPU runs at once when measured (the same host sharing, no communication)
            copies = f"1x{layout.world}" + ("-graph" if layout.cuda_graph else "")
            ref_spec = copies if copies in figures else layout.base
            exposed, hidden = _hidden_share(f["ms"], figures[ref_spec]["ms"], comm)
            measured.append((comm, hidden, f"collectives alone ({kind}, {params * 4 / 2**30:.2f} GiB fp32) {comm:.1f} "
                                           f"ms; step adds {exposed:.1f} ms over {ref_spec}"))
    if layout.ep > 1 and moe_blocks:
        # the dispatch and combine all-to-alls of each MoE block, forward and backward (their gradients): a rank's
        # routed rows (routed_rows of its micro-batch x T / cp tokens, C) in the compute dtype, over ep ranks
        numel = routed_rows(args.micro_batch * args.seq // layout.cp, moe) * n_embd
        comm = _comm_alone(layout, args, device, layout.ep, numel, "all_to_all",
                           count=4 * moe_blocks // layout.pp * accum, dtype=dtype)
        if comm is not None:
            dense = re.sub(r"\.ep\d+", "", layout.spec)  # the same ranks, every expert on every rank
            ref_spec = dense if dense in figures else layout.base
            exposed, hidden = _hidden_share(f["ms"], figures[ref_spec]["ms"], comm)
            measured.append((comm, hidden, f"expert all-to-alls alone (ep {layout.ep}) {comm:.1f} ms; step adds "
                                           f"{exposed:.1f} ms over {ref_spec}"))
    plain = re.sub(r"-p\d+(?=-|$)", "", layout.spec.replace("-ovl", "").replace("-symm", "").replace("-kern", "")
                   .replace("-ksig", "").replace("-pull", ""))
    if layout.tp_comm_overlap and plain in figures:
        # what the ring hides: each layer's two reduce-scatters (attention and MLP output) forward and the two
        # all-gathers of their gradients backward, (micro-batch, T / cp, C) in the compute dtype; the symmetric
        # implementation also the column layers' two all-gathers forward and two reduce-scatters backward
        numel = args.micro_batch * args.seq // layout.cp * n_embd
        symm = layout.tp_overlap_impl.startswith("symmetric")
        comm = _comm_alone(layout, args, device, layout.tp, numel, "sp_rs_ag",
                           count=(4 if symm else 2) * n_layer // layout.pp * accum, dtype=dtype)
        if comm is not None:
            saved = figures[plain]["ms"] - f["ms"]
            hidden = min(max(saved / comm, 0.0), 1.0) if comm > 0 else 0.0
            what = "sequence-parallel" if symm else "row-parallel"
            measured.append((comm, hidden, f"{what} reduce-scatters + all-gathers alone (tp {layout.tp}) "
                                           f"{comm:.1f} ms; the step is {saved:.1f} ms shorter than {plain}'s"))
    for comm, hidden, line in measured:
        results.add(case, layout.spec, "megakern", "comm ms", comm)
        results.add(case, layout.spec, "megakern", "comm hidden", hidden)
        print(f"{'':<16} {line}: {100 * hidden:.0f}% hidden", flush=True)


if __name__ == "__main__":
    main()
