"""profiles/probe_ln_welford.py on the test device (a CPU: the Triton interpreter, fp32): every probe variant (one
Chan merge or two reductions, a division or a reciprocal a step, unrolled or looped) and megakern's kernels match
torch's LayerNorm at widths that fill their steps and widths that do not (the probe checks each before timing); bad
sizes are clear errors."""
from pathlib import Path

import pytest
import torch

from benchmarks.common import import_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mod():
    from conftest import require_triton

    require_triton()
    return import_file(REPO / "profiles" / "probe_ln_welford.py", "probe_ln_welford")


@pytest.mark.parametrize("hidden", [64, 100])
def test_every_variant_matches_torch(mod, hidden):
    from conftest import DEVICE

    torch.manual_seed(hidden)
    results = mod.run(hidden, 3, DEVICE, [4], [32], rep_ms=5, with_compile=False)
    labels = [label for label, _, _ in results]
    assert len(labels) == 1 + 2 + 8 and len(set(labels)) == len(labels)
    assert all(ms > 0 and gbps > 0 for _, ms, gbps in results)


def test_against_and_no_probe(mod):
    """--against: main's module timed beside the checkout's, each just before it; --no-probe: megakern's alone."""
    from conftest import DEVICE
    from megakern import _norm_triton

    torch.manual_seed(2)
    results = mod.run(80, 2, DEVICE, [4], [32], rep_ms=5, with_compile=False, against=("main", _norm_triton),
                      probes=False)
    labels = [label for label, _, _ in results]
    assert labels == ["megakern table @main", "megakern table",
                      "megakern wide unrolled warps=4 chunk=32 sums=1 @main",
                      "megakern wide unrolled warps=4 chunk=32 sums=0 @main",
                      "megakern wide unrolled warps=4 chunk=32 sums=1", "megakern wide unrolled warps=4 chunk=32 sums=0"]
    with pytest.raises(SystemExit, match="not a file"):
        mod.main(["--hidden", "64", "--against", "/nonexistent/_norm_triton.py", "--device", "cpu"])


def test_probe_statistics(mod):
    """The probe's y on rows far from zero, against float64 (the run's check is against fp32 torch)."""
    from conftest import DEVICE

    torch.manual_seed(1)
    x = torch.randn(4, 96, device=DEVICE) * 0.5 + 1e3
    w, b = torch.randn(96, device=DEVICE), torch.randn(96, device=DEVICE)
    ref = torch.nn.functional.layer_norm(x.double(), (96,), w.double(), b.double(), mod.EPS)
    for _, kwargs in mod.variants([4], [32]):
        y = mod.probe_fwd(x, w, b, **kwargs)
        torch.testing.assert_close(y.double(), ref, rtol=1e-3, atol=1e-3, msg=str(kwargs))


def test_errors(mod):
    with pytest.raises(SystemExit, match="--chunks must be powers of two"):
        mod.main(["--chunks", "48", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--hidden and --mib must be >= 1"):
        mod.main(["--hidden", "0", "--device", "cpu"])
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        mod.probe_fwd(torch.randn(2, 64), torch.randn(64), torch.randn(64), 24, 4, True, True, True)
    with pytest.raises(ValueError, match="2-D with unit column stride"):
        mod.probe_fwd(torch.randn(2, 64).t(), torch.randn(2), torch.randn(2), 32, 4, True, True, True)
