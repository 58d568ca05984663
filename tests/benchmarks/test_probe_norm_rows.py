"""profiles/probe_norm_rows.py on CPU: rows read from a wider buffer give the contiguous rows' output (the probe
checks it against torch), a negative pad and an unknown op are clear errors."""
from pathlib import Path

import pytest
import torch

from benchmarks.common import import_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mod():
    from conftest import require_triton

    require_triton()
    return import_file(REPO / "profiles" / "probe_norm_rows.py", "probe_norm_rows")


def test_rows_view(mod):
    x = mod.rows_view(5, 48, 16, "cpu")
    assert x.shape == (5, 48) and x.stride() == (64, 1)
    with pytest.raises(ValueError, match="pad must be >= 0"):
        mod.rows_view(5, 48, -1, "cpu")


@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.parametrize("pad", [0, 16])
def test_probe_padded_rows(mod, is_rms, pad):
    torch.manual_seed(0)
    result = mod.probe(80, pad, is_rms, 7, "cpu")
    assert result["ms"] > 0 and result["gbps"] > 0


def test_unknown_op(mod):
    with pytest.raises(SystemExit, match="unknown --ops"):
        mod.main(["--ops", "rms,xx", "--device", "cpu"])
