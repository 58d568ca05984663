"""ParallelMesh.close(): a mesh's process groups are destroyed (their gloo threads end) and a new mesh of the same
layout works after it (torch's DTensor caches no longer hand out the closed mesh); the rank pool releases what each
check built, so its ranks' threads stay flat however many checks run."""
import gc

import torch
import torch.distributed as dist
from rankpool import pool, settled_threads
from torch.distributed.tensor import DTensor, Shard

from megakern.parallel import ParallelDims

LAYOUT = dict(tp=2, dp=2)  # 4 ranks: dp_cp is a group of 2, not the default group


def _gather_over_dp_cp(pm) -> list[float]:
    """A DTensor sharded over dp_cp, gathered (redistributed through the mesh's group)."""
    local = torch.full((2,), float(pm.rank))
    return DTensor.from_local(local, pm.dp_cp_mesh, [Shard(0)]).full_tensor().tolist()


def build_use_close(rounds: int) -> list:
    """``rounds`` times: build the mesh, gather over dp_cp, close it; this rank's gathers and thread counts."""
    out = []
    for _ in range(rounds):
        with ParallelDims(**LAYOUT).build("cpu", timeout=60) as pm:
            gathered = _gather_over_dp_cp(pm)
        assert pm.mesh is None and pm.dp_cp_mesh is None
        pm.close()  # a second close does nothing
        gc.collect()
        out.append((gathered, settled_threads()))
    return out


def build_and_leave() -> list[float]:
    """A check that builds a mesh and leaves it open: the pool closes it."""
    return _gather_over_dp_cp(ParallelDims(**LAYOUT).build("cpu", timeout=60))


def test_close_destroys_the_groups_and_a_new_mesh_of_the_layout_works():
    results = pool(4).run(build_use_close, 3)
    for rank, rounds in enumerate(results):
        tp_rank = rank % 2
        want = [float(tp_rank)] * 2 + [float(tp_rank + 2)] * 2  # dp_cp peers: ranks tp_rank and tp_rank + 2
        assert [g for g, _ in rounds] == [want] * 3, (rank, rounds)
        counts = [n for _, n in rounds]
        assert len(set(counts)) == 1, f"rank {rank}: threads after each closed mesh {counts}"


def test_pool_releases_each_checks_meshes():
    ranks = pool(4)
    ranks.run(build_and_leave)
    before = ranks.run(settled_threads)
    for _ in range(3):
        ranks.run(build_and_leave)
    after = ranks.run(settled_threads)
    assert after == before, f"threads per rank before {before}, after 3 more checks {after}"
    assert ranks.run(_live_groups) == [0] * 4


def _live_groups() -> int:
    from torch.distributed.distributed_c10d import _world

    return sum(g is not dist.group.WORLD for g in _world.pg_map)
