"""profiles/probe_compile_norm.py on CPU: the kernels are cut out of Inductor's output code, unknown ops, a CPU
device and bad sizes are clear errors (the probe itself needs a GPU)."""
from pathlib import Path

import pytest

from benchmarks.common import import_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mod():
    return import_file(REPO / "profiles" / "probe_compile_norm.py", "probe_compile_norm")


def test_kernel_source(mod):
    code = ("header\nasync_compile.triton('k0', '''\n@triton_heuristics.reduction(a)\ndef k0(): pass\n''', "
            "device_str='cuda')\nmiddle\nx = '''\n@triton_heuristics.pointwise(b)\ndef k1(): pass\n''', device_str=1")
    source = mod.kernel_source(code)
    assert "def k0(): pass" in source and "def k1(): pass" in source
    assert "header" not in source and "middle" not in source
    assert mod.kernel_source("no kernels here") == ""


def test_errors(mod):
    with pytest.raises(SystemExit, match="unknown --ops"):
        mod.main(["--ops", "rms,xx", "--device", "cpu"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        mod.main(["--ops", "rms", "--device", "cpu"])
    with pytest.raises(ValueError, match="hidden and mib must be >= 1"):
        mod.probe("rms", 0, 1, "cpu", set())
