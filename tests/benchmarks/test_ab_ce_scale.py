"""profiles/ab_ce_scale.py without a GPU: a --base that is missing or not a copy of the cross-entropy kernels is a
clear error, and so is a machine without CUDA (the timing needs one)."""
from pathlib import Path

import pytest
import torch

from benchmarks.common import import_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mod():
    return import_file(REPO / "profiles" / "ab_ce_scale.py", "ab_ce_scale")


def test_base_must_exist(mod, tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        mod.main(["--base", str(tmp_path / "missing.py")])


def test_base_must_be_the_module(mod, tmp_path):
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    with pytest.raises(SystemExit, match="not a copy of the cross-entropy kernels"):
        mod.main(["--base", str(other)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_needs_cuda(mod, tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text((REPO / "megakern" / "_cross_entropy_triton.py").read_text())
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        mod.main(["--base", str(copy)])
