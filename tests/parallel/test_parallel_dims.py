"""ParallelDims (sizes, rank order, model checks), initialization that cannot hang (a rank that never joins, an
unreachable rendezvous, a collective that never completes), the rendezvous kept on the mesh, agreement across
ranks, and bad layouts."""
import time

import pytest
import torch
import torch.distributed as dist
from rankpool import free_port, pool, spawn

from megakern.parallel import (DisagreementError, ParallelDims, RendezvousError, check_agreement, config_hash,
                               init_distributed)


# ---- sizes and order (no processes) ------------------------------------------------------------------------------
def test_dims_resolve_and_rank_order_tp_fastest():
    d = ParallelDims(tp=2, cp=2, pp=2).resolve(16)
    assert (d.pp, d.dp, d.cp, d.tp, d.world_size) == (2, 2, 2, 2, 16)
    assert d.coordinate(1) == {"pp": 0, "dp": 0, "cp": 0, "tp": 1}
    assert d.coordinate(2) == {"pp": 0, "dp": 0, "cp": 1, "tp": 0}
    assert d.coordinate(4) == {"pp": 0, "dp": 1, "cp": 0, "tp": 0}
    assert d.coordinate(8) == {"pp": 1, "dp": 0, "cp": 0, "tp": 0}
    assert all(d.rank_of(**d.coordinate(r)) == r for r in range(16))
    assert ParallelDims(tp=2, dp=3).resolve(6).dp == 3


@pytest.mark.parametrize("kwargs,world,message", [
    (dict(tp=0), 4, "tp must be an int >= 1, got 0"),
    (dict(dp=-2), 4, "dp must be an int >= 1, or -1"),
    (dict(ep=3), 4, "ep=3 does not divide dp\\*cp = 4\\*1 = 4"),
    (dict(tp=3), 4, "world size 4 is not divisible by pp\\*cp\\*tp = 1\\*1\\*3 = 3"),
    (dict(tp=2, dp=3), 4, "pp\\*dp\\*cp\\*tp = 1\\*3\\*1\\*2 = 6 != world size 4"),
    (dict(tp=2, world_size=4), 8, "world_size 4 was given, but the run has 8 ranks"),
])
def test_dims_errors_name_the_numbers(kwargs, world, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs).resolve(world)


@pytest.mark.parametrize("dims,model,message", [
    (dict(tp=4), dict(n_head=6), "6 attention heads are not divisible by tp=4"),
    (dict(tp=4), dict(n_kv_head=2), "2 key/value heads are not divisible by tp=4"),
    (dict(pp=3), dict(n_layer=4), "4 layers are not divisible into pp\\*stages_per_rank = 3\\*1 = 3"),
    (dict(tp=3), dict(n_head=6, n_kv_head=6, vocab=128, ffn_hidden=96), "padded vocabulary \\(128\\) is not divisible"),
    (dict(cp=2), dict(seqlen=18), "sequence length 18 is not divisible by 2\\*cp = 4"),
    (dict(cp=2, tp=4), dict(seqlen=12, sequence_parallel=True), "each cp rank's 6 tokens are not divisible by tp=4"),
])
def test_model_split_errors(dims, model, message):
    spec = dict(n_layer=4, n_head=8, n_kv_head=4, vocab=256, ffn_hidden=128)
    spec.update(model)
    d = ParallelDims(**dims).resolve(None)
    with pytest.raises(ValueError, match=message):
        d.check_model(**spec)


def test_config_hash_is_stable_and_sensitive():
    from megakern.models.gpt import GPTConfig

    a, b = GPTConfig.preset("gpt-tiny"), GPTConfig.preset("gpt-tiny")
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(GPTConfig.preset("gpt-tiny", n_layer=2))


# ---- initialization that cannot hang -----------------------------------------------------------------------------
def _join(rank, world, port, timeout):
    start = time.monotonic()
    try:
        init_distributed(backend="gloo", rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                         timeout=timeout, device_type="cpu")
    except RendezvousError as exc:
        return str(exc), time.monotonic() - start
    dist.destroy_process_group()
    return "joined", time.monotonic() - start


def test_rank_that_never_joins_is_named_within_the_timeout():
    port = free_port()
    out = spawn(_join, [0, 1], 3, port, 3.0, timeout=60)  # world of 3: rank 2 never starts
    for rank, (message, took) in out.items():
        assert f"rendezvous at tcp://127.0.0.1:{port}: ranks [2] of 3 did not join within 3 s" in message, message
        assert took < 3.0 + 5.0, f"rank {rank} waited {took:.1f} s"


def _kept(rank, port):
    import os
    import socket

    rendezvous = init_distributed(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                                  timeout=30.0, device_type="cpu")
    mesh = ParallelDims().build("cpu", rendezvous=rendezvous)
    bare = ParallelDims().build("cpu")  # on a process group made before: no rendezvous unless given
    try:
        bare.store_prefix("watchdog")
    except RuntimeError as exc:
        error = str(exc)
    mesh.store.set(f"from/{rank}", str(rank))
    other = mesh.store.get(f"from/{1 - rank}").decode()  # the store every rank shares
    out = (rendezvous.address, rendezvous.host, rendezvous.attempt, type(mesh.store).__name__, mesh.store is
           rendezvous.store, bare.store, mesh.store_prefix("watchdog"), mesh.store_prefix("watchdog"), other, error,
           f"{socket.gethostname()}:{os.getpid()}")
    # rank 0 hosts the store: it must not end before rank 1's get above is answered (a reset connection otherwise)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_rendezvous_is_returned_and_kept_on_the_mesh():
    port = free_port()
    out = spawn(_kept, [0, 1], port, timeout=60)
    for rank, (address, host, attempt, kind, same, bare, first, second, other, error, _) in out.items():
        assert address == f"tcp://127.0.0.1:{port}" and kind == "TCPStore" and same and bare is None
        assert host == f"rank 0 ({out[0][-1]})", host  # who hosts the store: rank 0's process, by name
        assert (attempt, first, second, other) == ("0", "megakern/watchdog/0/1", "megakern/watchdog/0/2",
                                                   str(1 - rank))
        assert "no rendezvous store (torch.distributed was initialized outside init_distributed" in error


def test_unreachable_rendezvous_names_rank_0():
    port = free_port()
    out = spawn(_join, [1], 2, port, 2.0, timeout=60)  # rank 0, the store's host, never starts
    message, took = out[1]
    assert f"rank 1 could not reach the rendezvous at tcp://127.0.0.1:{port}" in message, message
    assert "missing: rank 0" in message and took < 2.0 + 8.0


def _hang(rank, port):
    init_distributed(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                     timeout=2.0, device_type="cpu")
    start = time.monotonic()
    try:
        if rank == 1:  # rank 0 never enters the collective
            dist.all_reduce(torch.ones(3))
        else:
            time.sleep(4.0)
        return "no error", time.monotonic() - start
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start


def test_collective_that_never_completes_raises_within_the_timeout():
    out = spawn(_hang, [0, 1], free_port(), timeout=60)
    message, took = out[1]
    assert "timed out" in message.lower() or "timeout" in message.lower(), message
    assert took < 2.0 + 5.0


# ---- on a running world ------------------------------------------------------------------------------------------
def _agreement_and_bad_layouts():
    from gpt_check import tiny_config

    from megakern.models.gpt import GPT
    from megakern.parallel import parallelize

    rank = dist.get_rank()
    errors = {}
    try:
        check_agreement({"config": "abc", "torch": "2.x" if rank == 0 else "2.y"})
    except DisagreementError as exc:
        errors["agree"] = str(exc)
    try:
        ParallelDims(tp=2).build("cpu", timeout=30, agree={"config": {"lr": 0.1 * (rank + 1)}})
    except DisagreementError as exc:
        errors["build"] = str(exc)
    try:
        init_distributed(backend="gloo", rank=rank, world_size=2)
    except RuntimeError as exc:
        errors["double"] = str(exc)
    try:
        ParallelDims(tp=3).build("cpu", timeout=30)
    except ValueError as exc:
        errors["world"] = str(exc)
    pm = ParallelDims(pp=2).build("cpu", timeout=30)
    cases = {
        "zero1": dict(dp_shard="fsdp", zero1=True),
        "interleaved": dict(pp_schedule="interleaved-1f1b", microbatches=2),   # 2 layers, 4 stages
        "1f1b": dict(pp_schedule="1f1b", microbatches=1),
        "schedule": dict(pp_schedule="zero-bubble"),
    }
    for name, options in cases.items():
        try:
            parallelize(GPT(tiny_config("gpt", 2)), pm, None, **options)
        except ValueError as exc:
            errors[name] = str(exc)
    try:
        dropout = tiny_config("gpt", 2)
        dropout.dropout = 0.1
        parallelize(GPT(dropout), ParallelDims(tp=2).build("cpu", timeout=30), None, rng=torch.Generator())
    except TypeError as exc:
        errors["rng"] = str(exc)
    pmodel = parallelize(GPT(tiny_config("gpt", 2)), pm, None, pp_schedule="gpipe", microbatches=2)
    idx = torch.randint(0, 120, (3, 16))
    try:
        pmodel.forward_backward(idx, idx)
    except ValueError as exc:
        errors["batch"] = str(exc)
    return errors


def test_agreement_double_init_and_bad_layouts():
    for errors in pool(2).run(_agreement_and_bad_layouts):
        assert "torch: ranks [0] have '2.x'; ranks [1] have '2.y'" in errors["agree"]
        assert "hash(config)" in errors["build"] and "ranks [0]" in errors["build"]
        assert "already initialized (backend gloo, world size 2)" in errors["double"]
        assert "world size 2 is not divisible by pp*cp*tp = 1*1*3 = 3" in errors["world"]
        assert "zero1 shards the optimizer of DDP" in errors["zero1"]
        assert "2 layers are not divisible into pp*stages_per_rank = 2*2 = 4" in errors["interleaved"]
        assert "1f1b needs at least pp=2 micro-batches, got 1" in errors["1f1b"]
        assert "unknown schedule 'zero-bubble'" in errors["schedule"]
        assert "batch 3 is not divisible into 2 micro-batches" in errors["batch"]
        assert "rng must be an RNGTracker, got Generator" in errors["rng"]
