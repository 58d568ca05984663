"""Packaging: parallel/ and models/ install as megakern.parallel and megakern.models (no top-level `models`), and
a plain `pip install .` carries the kernel sources for the NVRTC path."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pip_install_gives_working_imports(tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
                           "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (target / "models").exists() and not (target / "parallel").exists()
    assert (target / "megakern" / "_csrc" / "norm" / "norm.cu").is_file()
    check = ("import megakern, megakern.data.gpt_dataset, megakern.parallel, megakern.models, megakern._cuda as c; "
             "print(megakern.__file__); print(c.csrc_root())")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert str(target) in out.stdout and "_csrc" in out.stdout


def test_subpackages_import():
    try:
        import megakern.models
        import megakern.parallel
    except ModuleNotFoundError as exc:
        pytest.skip(f"megakern is not installed (pip install -e .): {exc}")
    assert megakern.parallel.__doc__ and megakern.models.__doc__
