"""profiles/ab_norm_fwd_team.py without a GPU: widths the team kernel does not take and unknown ops are clear
errors, and so is a machine without CUDA (the timing needs one)."""
from pathlib import Path

import pytest
import torch

from benchmarks.common import import_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ab():
    return import_file(REPO / "profiles" / "ab_norm_fwd_team.py", "ab_norm_fwd_team")


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
