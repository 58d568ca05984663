"""Dropout under tensor (+ sequence) parallelism through the RNG tracker (parallel/rng.py): the ranks' masks have the
promised structure and the single-process model replaying them trains identically; the tracker itself."""
import pytest
import torch
from dropout_check import check_dropout
from rankpool import pool

from megakern.parallel import RNGTracker, region_seed
from megakern.parallel.rng import default_generator


@pytest.mark.parametrize("style,sp,recompute", [("gpt", False, "none"), ("llama", True, "none"), ("gpt", True, "none"),
                                               ("llama", True, "full")])
def test_tensor_parallel_dropout(style, sp, recompute):
    results = pool(2).run(check_dropout, dict(tp=2), dict(sequence_parallel=sp), style=style, recompute=recompute)
    assert len({r[0] for r in results}) == 1, results
    seeds = {r[1] for r in results}  # tp ranks' region seeds: one (replicated) or one each (sequence shards)
    assert len(seeds) == (2 if sp else 1), results


def test_tensor_and_data_parallel_dropout():
    # tp2 (SP) x dp2: masks differ across tp ranks (sequence shards) and across dp ranks (other samples)
    results = pool(4).run(check_dropout, dict(tp=2, dp=2), dict(sequence_parallel=True, dp_shard="fsdp"))
    assert len({r[1] for r in results}) == 4, results


def test_pipeline_tensor_parallel_dropout():
    # pp2 (one micro-batch, so the draws follow the single model's order) x tp2 (SP): each stage forks its own region
    results = pool(4).run(check_dropout, dict(tp=2, pp=2), dict(sequence_parallel=True, pp_schedule="gpipe",
                                                                 microbatches=1))
    assert len({r[0] for r in results}) == 1 and len({r[1] for r in results}) == 4, results


def test_rng_tracker_forks_and_restores():
    torch.manual_seed(5)
    before = torch.default_generator.get_state()
    t = RNGTracker(3, "cpu", dp_rank=1, cp_rank=0, tp_rank=1)
    with t.fork("replicated"):
        a = torch.rand(6)
    with t.fork("replicated"):
        b = torch.rand(6)
    assert torch.equal(torch.default_generator.get_state(), before), "the default generator was moved"
    assert not torch.equal(a, b), "a region's state must advance"
    # reproducible by seed and coordinates; the replicated region ignores the tp rank
    same = RNGTracker(3, "cpu", dp_rank=1, cp_rank=0, tp_rank=0)
    with same.fork("replicated"):
        assert torch.equal(torch.rand(6), a)
    with same.fork("tensor_parallel"):
        c = torch.rand(6)
    with t.fork("tensor_parallel"):
        assert not torch.equal(torch.rand(6), c), "tp ranks share a tensor-parallel stream"
    with RNGTracker(4, "cpu", dp_rank=1).fork("replicated"):
        assert not torch.equal(torch.rand(6), a), "another seed draws the same"
    seeds = {region_seed(3, "replicated", stage=s, dp_rank=d, cp_rank=c) for s in range(2) for d in range(2)
             for c in range(2)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    # the state survives an error and round-trips through state_dict
    with pytest.raises(KeyError):
        with t.fork("replicated"):
            torch.rand(3)
            raise KeyError("inside")
    assert torch.equal(torch.default_generator.get_state(), before)
    saved = t.state_dict()
    with t.fork("replicated"):
        d = torch.rand(6)
    t.load_state_dict(saved)
    with t.fork("replicated"):
        assert torch.equal(torch.rand(6), d)


def test_rng_tracker_refuses_bad_use():
    t = RNGTracker(0)
    with pytest.raises(ValueError, match="unknown region 'sequence'"):
        with t.fork("sequence"):
            pass
    with pytest.raises(RuntimeError, match="already inside a fork"):
        with t.fork("replicated"), t.fork("tensor_parallel"):
            pass
    with pytest.raises(TypeError, match="seed must be an int"):
        RNGTracker(1.5)
    with pytest.raises(ValueError, match="saved states are of seed 0"):
        RNGTracker(1).load_state_dict(t.state_dict())
    assert default_generator("cpu") is torch.default_generator


@pytest.mark.gpu
def test_rng_tracker_forks_the_cuda_generator():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = default_generator("cuda")
    before_cpu, before = torch.default_generator.get_state(), gen.get_state()
    t = RNGTracker(9, "cuda")
    with t.fork("tensor_parallel"):
        a = torch.rand(1000, device="cuda")
    assert torch.equal(gen.get_state(), before) and torch.equal(torch.default_generator.get_state(), before_cpu)
    with RNGTracker(9, torch.device("cuda", torch.cuda.current_device())).fork("tensor_parallel"):
        assert torch.equal(torch.rand(1000, device="cuda"), a)
    with t.fork("tensor_parallel"):
        x = torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.25)
    assert abs(float((x == 0).float().mean()) - 0.25) < 0.05
