"""profiles/ab_norm_fwd_team.py and its Nsight Compute driver, profiles/ncu_norm_fwd.py, without a GPU: widths the
team kernel does not take and unknown ops are clear errors, and so is a machine without CUDA (the kernels need one);
the A/B's reload geometries are launches the forward takes."""
from pathlib import Path

import pytest
import torch

from benchmarks.common import import_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=("ab_norm_fwd_team", "ncu_norm_fwd"))
def ab(request):
    with pytest.MonkeyPatch.context() as mp:  # the Nsight Compute driver imports the A/B's checks from beside it
        mp.syspath_prepend(str(REPO / "profiles"))
        return import_file(REPO / "profiles" / f"{request.param}.py", request.param)


@pytest.mark.parametrize("hidden", ("1001", "32768", "a,b"))
def test_widths_it_cannot_take(ab, hidden):
    with pytest.raises(SystemExit, match="does not take bf16 rows|not a comma-separated list"):
        ab.main(["--hidden", hidden])


def test_unknown_op(ab):
    with pytest.raises(SystemExit, match="unknown op"):
        ab.main(["--ops", "rms,batchnorm"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_needs_cuda(ab):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        ab.main(["--hidden", "1024"])


def test_reload_geometries_are_launches_the_forward_takes():
    from megakern import _norm_cuda

    ab = import_file(REPO / "profiles" / "ab_norm_fwd_team.py", "ab_norm_fwd_team")
    for n in (8, 1024, 1032, 4096, 5120, 16384):
        configs = ab.reload_geometries(n)
        assert configs and configs[-1].nv == _norm_cuda.TEAM_CHUNKS[-1], n
        for config in configs:
            _norm_cuda.check_fwd_config(config)
            assert config.reload and not config.persistent and config.threads * config.nv * 8 >= n, (n, config)
