"""The parallel stack on several GPUs (NCCL): the training program under torchrun, in each layout, against the same
run on one GPU. fp32, a small GPT, the same global batch and data: every layout's losses equal the one-GPU run's
(up to reduction order). Layouts needing more GPUs than the machine has are skipped with the count.

The run per layout goes through everything a real multi-GPU run does: NCCL init with its timeout and agreement
check, the device mesh, tensor parallelism with sequence parallelism (vocab-parallel embedding and cross-entropy),
pipeline schedules (GPipe, 1F1B, interleaved 1F1B), ring attention, FSDP2 / DDP / ZeRO-1, gradient clipping across
groups, the fused optimizer, and the data loader's data-parallel split.

MEGAKERN_TEST_MULTI_CPU=N runs the same checks with gloo ranks on CPU as if there were 2N devices (slow; for
developing the test itself).
"""
from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from rankpool import free_port

from megakern.train.log import read_records
from benchmarks.common import run_launch

REPO = Path(__file__).resolve().parents[2]
ON_CPU = os.environ.get("MEGAKERN_TEST_MULTI_CPU", "0") != "0"
DEVICES = int(os.environ["MEGAKERN_TEST_MULTI_CPU"]) * 2 if ON_CPU else torch.cuda.device_count()
STEPS = 6
pytestmark = [] if ON_CPU else pytest.mark.gpu
COMMON = ["model.preset=gpt-tiny", "model.n_layer=4", "model.n_embd=64", "model.n_head=4", "model.max_seqlen=64",
          "model.dropout=0.0", "train.precision=fp32", f"train.device={'cpu' if ON_CPU else 'cuda'}",
          "train.micro_batch_size=2", "train.global_batch_size=8", f"train.steps={STEPS}", "optim.lr=3e-3",
          "schedule.warmup_steps=2", "eval.every=0", "checkpoint.every=0", "checkpoint.final=false",
          "train.sample_tokens=0", "log.progress=false", "log.tensorboard=false", "data.num_workers=0",
          "train.cuda_graph=false"]  # eager steps unless a layout adds GRAPH
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "OMP_NUM_THREADS": "1"}

GRAPH = ["train.cuda_graph=true", "train.cuda_graph_warmup=2"]
SYMM = ["parallel.tp_overlap_impl=symmetric"]  # tp_comm_overlap peer to peer through symmetric memory
BF16 = ["train.precision=bf16"]  # bf16 weights with fp32 master weights
PACKED = ["data.packed_documents=true"]  # documents packed into each row (cu_seqlens)
# MoE blocks (every block: 4 experts of 64 units, top-2, dropless); the one-GPU reference has the same ones
MOE = ["model.n_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=64"]
CAPACITY = ["model.moe_capacity_factor=1.25"]  # each expert keeps 1.25 x its even share of a micro-batch's tokens
EP = ["parallel.dp_shard=ddp"]  # expert parallelism: ep ranks carved out of dp x cp, dense replicas kept by DDP
# DDP's reducer reads timings on the host in its first 10 iterations: 11 eager steps, then 4 replays
LONG_STEPS = 15
DDP_GRAPH = ["train.cuda_graph=true", "train.cuda_graph_warmup=11", f"train.steps={LONG_STEPS}"]

# (id, GPUs, overrides): each against the one-GPU run with the same train.steps
LAYOUTS = [
    ("dp2-fsdp", 2, ["parallel.dp=2", "parallel.dp_shard=fsdp"]),
    ("dp2-ddp", 2, ["parallel.dp=2", "parallel.dp_shard=ddp"]),
    ("tp2-sp", 2, ["parallel.tp=2"]),
    ("tp2-sp-overlap", 2, ["parallel.tp=2", "parallel.tp_comm_overlap=true"]),
    ("pp2-1f1b", 2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    ("pp2-gpipe", 2, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    ("pp2-interleaved", 2, ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b"]),
    ("cp2", 2, ["parallel.cp=2"]),
    ("tp2-dp2", 4, ["parallel.tp=2", "parallel.dp=2"]),
    ("tp2-pp2", 4, ["parallel.tp=2", "parallel.pp=2"]),
    ("pp2-cp2", 4, ["parallel.pp=2", "parallel.cp=2"]),
    ("tp2-cp2", 4, ["parallel.tp=2", "parallel.cp=2"]),
    ("dp4-ddp-zero1", 4, ["parallel.dp=4", "parallel.dp_shard=ddp", "parallel.zero1=true"]),
    ("tp4", 4, ["parallel.tp=4"]),
    ("tp4-overlap", 4, ["parallel.tp=4", "parallel.tp_comm_overlap=true"]),
    # the row and column layers' ops peer to peer through symmetric memory
    ("tp2-sp-overlap-symm", 2, ["parallel.tp=2", "parallel.tp_comm_overlap=true", *SYMM]),
    ("tp4-overlap-symm", 4, ["parallel.tp=4", "parallel.tp_comm_overlap=true", *SYMM]),
    ("tp2-pp2-dp2", 8, ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"]),
    ("tp2-pp2-cp2", 8, ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2"]),
    # the step captured in a CUDA graph (collectives included) and replayed from the warm-up's end on
    ("tp2-sp-graph", 2, ["parallel.tp=2", *GRAPH]),
    ("tp2-sp-overlap-graph", 2, ["parallel.tp=2", "parallel.tp_comm_overlap=true", *GRAPH]),
    ("tp2-sp-overlap-symm-graph", 2, ["parallel.tp=2", "parallel.tp_comm_overlap=true", *SYMM, *GRAPH]),
    ("tp2-sp-overlap-symm-kern-graph", 2, ["parallel.tp=2", "parallel.tp_comm_overlap=true",
                                           "parallel.tp_overlap_impl=symmetric-kernel", *GRAPH]),
    ("dp2-ddp-graph", 2, ["parallel.dp=2", "parallel.dp_shard=ddp", *DDP_GRAPH]),
    ("cp2-ddp-graph", 2, ["parallel.cp=2", "parallel.dp_shard=ddp", *DDP_GRAPH]),
    ("tp2-dp2-ddp-graph", 4, ["parallel.tp=2", "parallel.dp=2", "parallel.dp_shard=ddp", *DDP_GRAPH]),
    # the training features, each against one GPU with the same features (FEATURE_KEYS)
    ("tp2-bf16", 2, ["parallel.tp=2", *BF16]),
    ("dp2-ddp-bf16", 2, ["parallel.dp=2", "parallel.dp_shard=ddp", *BF16]),
    ("dp2-fsdp-bf16", 2, ["parallel.dp=2", "parallel.dp_shard=fsdp", *BF16]),
    ("pp2-bf16", 2, ["parallel.pp=2", *BF16]),
    ("cp2-bf16", 2, ["parallel.cp=2", *BF16]),
    ("dp4-zero1-bf16", 4, ["parallel.dp=4", "parallel.dp_shard=ddp", "parallel.zero1=true", *BF16]),
    ("tp2-fp8", 2, ["parallel.tp=2", *BF16, "train.fp8=delayed"]),
    ("dp2-fsdp-fp8", 2, ["parallel.dp=2", "parallel.dp_shard=fsdp", *BF16, "train.fp8=current"]),
    ("tp2-compile", 2, ["parallel.tp=2", "train.compile=true"]),
    ("dp2-fsdp-compile", 2, ["parallel.dp=2", "parallel.dp_shard=fsdp", "train.compile=true"]),
    ("tp2-recompute", 2, ["parallel.tp=2", "model.recompute=full"]),
    ("tp2-dp2-bf16-graph", 4, ["parallel.tp=2", "parallel.dp=2", "parallel.dp_shard=ddp", *BF16, *DDP_GRAPH]),
    ("pp2-fp8", 2, ["parallel.pp=2", *BF16, "train.fp8=delayed"]),
    ("pp2-interleaved-bf16", 2, ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", *BF16]),
    ("tp2-packed", 2, ["parallel.tp=2", *PACKED]),
    ("cp2-packed", 2, ["parallel.cp=2", *PACKED]),
    ("pp2-packed", 2, ["parallel.pp=2", *PACKED]),
    ("tp2-pp2-bf16-compile", 4, ["parallel.tp=2", "parallel.pp=2", *BF16, "train.compile=true"]),
    ("tp2-cp2-bf16-recompute", 4, ["parallel.tp=2", "parallel.cp=2", *BF16, "model.recompute=full"]),
    # Mixture of Experts: experts whole per rank (DP, TP, PP), or sharded over ep ranks (all-to-all dispatch)
    ("dp2-moe", 2, ["parallel.dp=2", "parallel.dp_shard=ddp", *MOE]),
    ("tp2-moe", 2, ["parallel.tp=2", *MOE]),
    ("pp2-moe", 2, ["parallel.pp=2", *MOE]),
    ("ep2-moe", 2, ["parallel.dp=2", "parallel.ep=2", *EP, *MOE]),
    ("ep2-cp2-moe", 2, ["parallel.cp=2", "parallel.ep=2", *EP, *MOE]),
    ("ep2-moe-bf16", 2, ["parallel.dp=2", "parallel.ep=2", *EP, *MOE, *BF16]),
    ("ep4-moe", 4, ["parallel.dp=4", "parallel.ep=4", *EP, *MOE]),
    ("ep2-dp2-moe", 4, ["parallel.dp=4", "parallel.ep=2", *EP, *MOE]),
    ("ep2-tp2-moe", 4, ["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", *EP, *MOE]),
    ("ep2-pp2-moe", 4, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", *EP, *MOE]),
    # FSDP2: dense parameters sharded over dp, each MoE layer's experts over their edp group (one rank at ep2 = dp2,
    # a pair at ep2 x dp2), with bf16 masters on two GPUs
    ("ep2-moe-fsdp-bf16", 2, ["parallel.dp=2", "parallel.ep=2", "parallel.dp_shard=fsdp", *MOE, *BF16]),
    ("ep2-dp2-moe-fsdp", 4, ["parallel.dp=4", "parallel.ep=2", "parallel.dp_shard=fsdp", *MOE]),
    # a capacity factor: the fixed-size dispatch (no host read), eager and captured in a CUDA graph
    ("ep2-moe-capacity", 2, ["parallel.dp=2", "parallel.ep=2", *EP, *MOE, *CAPACITY]),
    ("ep2-moe-capacity-graph", 2, ["parallel.dp=2", "parallel.ep=2", *EP, *MOE, *CAPACITY, *DDP_GRAPH]),
    ("ep2-dp2-moe-capacity-graph", 4, ["parallel.dp=4", "parallel.ep=2", *EP, *MOE, *CAPACITY, *DDP_GRAPH]),
]
# fp32: the layouts sum in other orders (sharded matmuls, ring-attention merges, reductions over ranks); bf16 and
# FP8 round those partial sums too
ABS_TOL, LOW_PRECISION_TOL = 2e-3, 3e-2
# the overrides that make a feature run: its one-GPU reference runs with the same ones
FEATURE_KEYS = ("train.precision=", "train.fp8=", "train.compile=", "model.recompute=", "data.packed_documents=",
                "model.n_experts=", "model.moe_")
# runs sharing a GPU at once (the model is tiny: start-up, not the GPU, bounds each run)
RUNS_PER_GPU = int(os.environ.get("MEGAKERN_TEST_RUNS_PER_GPU", "1" if ON_CPU else "3"))


def _features(overrides: list[str]) -> tuple[str, ...]:
    return tuple(o for o in overrides if o.startswith(FEATURE_KEYS))


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_records(run_dir) if "train/loss" in r}


def _run(run_dir: Path, data_cache: Path, world: int, overrides: list[str], devices: list[int] | None,
         attempts: int = 3):
    """One run of the training program (torchrun over ``world`` ranks): (losses, stdout), or (None, the error). Runs
    start concurrently, so the port free_port() found may be taken by another's rendezvous before this one binds it:
    such a launch is tried again on another port (in a fresh run directory), up to ``attempts`` times."""
    for attempt in range(attempts):
        where = run_dir if attempt == 0 else run_dir.with_name(f"{run_dir.name}-retry{attempt}")
        args = [*COMMON, *overrides, f"data.cache_dir={data_cache}", f"log.run_dir={where}"]
        if world == 1:
            cmd = [sys.executable, "-m", "megakern.train", *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
                   str(free_port()), "-m", "megakern.train", *args]
        env = {**os.environ, **ENV}
        if devices is not None and not ON_CPU:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        proc = run_launch(cmd, cwd=REPO, timeout=900, env=env)
        if proc.returncode == 0:
            return _losses(where), proc.stdout
        error = f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        if "EADDRINUSE" not in proc.stderr:
            break
    return None, error


def _selected(session) -> set[str]:
    """The layouts of the tests pytest will run (after -k / node ids): only those are launched."""
    return {item.callspec.params["name"] for item in session.items
            if item.module.__name__ == __name__ and hasattr(item, "callspec")}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected layout this machine can hold, run concurrently on disjoint GPUs after the one-GPU reference
    (which tokenizes the corpus into the shared cache first)."""
    if DEVICES < 2 and not ON_CPU:
        pytest.skip(f"needs at least 2 CUDA devices, this machine has {DEVICES}")
    tmp = tmp_path_factory.mktemp("multi")
    data_cache = tmp / "data"
    reference, out = _run(tmp / "one", data_cache, 1, [], [0])
    assert reference is not None, out
    selected = _selected(request.session)
    fitting = [(name, world, o) for name, world, o in LAYOUTS if world <= DEVICES and name in selected
               and not (ON_CPU and "train.cuda_graph=true" in o)]
    keys = sorted({(_steps(o), _features(o)) for _, _, o in fitting} - {(STEPS, ())})
    # a slot is a share of one GPU; a run takes one slot on each of ``world`` distinct GPUs
    slots, ready = {d: RUNS_PER_GPU for d in range(DEVICES)}, threading.Condition()

    def on_devices(world: int, work):
        with ready:  # all of a run's devices at once (taking them one by one could deadlock two runs)
            ready.wait_for(lambda: sum(n > 0 for n in slots.values()) >= world)
            devices = sorted(slots, key=lambda d: -slots[d])[:world]
            for d in devices:
                slots[d] -= 1
        try:
            return work(devices)
        finally:
            with ready:
                for d in devices:
                    slots[d] += 1
                ready.notify_all()

    def reference_job(key):  # one one-GPU reference per (steps, features)
        return key, on_devices(1, lambda devices: _run(tmp / f"one-{keys.index(key)}", data_cache, 1,
                                                       [f"train.steps={key[0]}", *key[1]], devices))

    with ThreadPoolExecutor(max_workers=max(1, DEVICES * RUNS_PER_GPU)) as pool:
        references = {(STEPS, ()): reference}
        for key, (losses, out) in pool.map(reference_job, keys):
            assert losses is not None, out
            references[key] = losses

    def job(item):
        name, world, overrides = item

        def work(devices):
            losses, out = _run(tmp / name, data_cache, world, overrides, devices)
            ref = references[(_steps(overrides), _features(overrides))]
            diff = "failed" if losses is None else (
                f"max |loss - one GPU's| {max(abs(losses[s] - ref.get(s, float('inf'))) for s in losses):.2e}")
            print(f"[multi-gpu] {name} on devices {devices}: {diff}", file=sys.__stdout__, flush=True)
            return name, (losses, out)
        return on_devices(world, work)

    with ThreadPoolExecutor(max_workers=max(1, DEVICES * RUNS_PER_GPU // 2)) as pool:  # largest first
        done = dict(pool.map(job, sorted(fitting, key=lambda item: -item[1])))
    return references, done


def _steps(overrides: list[str]) -> int:
    return LONG_STEPS if f"train.steps={LONG_STEPS}" in overrides else STEPS


@pytest.mark.parametrize("name,world", [(n, w) for n, w, _ in LAYOUTS], ids=[n for n, _, _ in LAYOUTS])
def test_layout_matches_one_gpu(runs, name, world):
    if world > DEVICES:
        pytest.skip(f"{name} needs {world} devices, this machine has {DEVICES}")
    overrides = dict((n, o) for n, _, o in LAYOUTS)[name]
    if ON_CPU and "train.cuda_graph=true" in overrides:
        pytest.skip(f"{name}: CUDA graphs need GPUs")
    references, done = runs
    steps = _steps(overrides)
    reference = references[(steps, _features(overrides))]
    losses, out = done[name]
    assert losses is not None, f"{name}: {out}"
    assert sorted(losses) == list(range(1, steps + 1)), out[-2000:]
    if "train.cuda_graph=true" in overrides:
        warmup = int(next(o for o in overrides if o.startswith("train.cuda_graph_warmup=")).split("=")[1])
        assert f"step {warmup + 1}: captured the training step in a CUDA graph" in out, out[-2000:]
    diffs = {s: abs(losses[s] - reference[s]) for s in losses}
    low = any(o in overrides for o in ("train.precision=bf16", "train.precision=bf16-autocast")) or any(
        o.startswith("train.fp8=") for o in overrides)
    assert max(diffs.values()) <= (LOW_PRECISION_TOL if low else ABS_TOL), (
        f"{name}: losses {[round(losses[s], 5) for s in sorted(losses)]} vs one device "
        f"{[round(reference[s], 5) for s in sorted(reference)]}")
