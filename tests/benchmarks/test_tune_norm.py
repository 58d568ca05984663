"""profiles/tune_norm.py's A/B (--against REV, --against-csrc REV) on CPU: the revision's megakern/_norm_triton.py
loaded beside the checkout's computes what the checkout's does (at HEAD they are the same source), the Triton
launchers are timed with both and the CUDA ones once (twice, through NVRTC, with --against-csrc, whose sources the
NVRTC path then compiles from), and a revision that does not exist is a clear error."""
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.common import import_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tune():
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode:
        pytest.skip("not a git checkout: --against reads a revision's source with git")
    return import_file(REPO / "profiles" / "tune_norm.py", "tune_norm")


def test_against_head_matches_the_checkout(tune, tmp_path):
    from conftest import DEVICE, require_triton

    require_triton()
    from megakern import _norm_triton

    old = tune.load_revision("HEAD", str(tmp_path))
    assert old is not _norm_triton and old.__file__ == str(tmp_path / "_norm_triton_against.py")
    source = subprocess.run(["git", "show", "HEAD:megakern/_norm_triton.py"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    if source != (REPO / "megakern" / "_norm_triton.py").read_text():
        pytest.skip("megakern/_norm_triton.py differs from HEAD's in this checkout")
    torch.manual_seed(0)
    x = torch.randn(5, 48, device=DEVICE)
    w, b = torch.randn(48, device=DEVICE), torch.randn(48, device=DEVICE)
    for is_rms in (True, False):
        bias = None if is_rms else b
        want = _norm_triton.fwd(x, None, w, bias, 1e-5, is_rms)
        got = old.fwd(x, None, w, bias, 1e-5, is_rms)
        for g, r in zip(got, want):
            assert (g is None) == (r is None)
            if r is not None:
                assert torch.equal(g, r)


def test_variants(tune):
    module = object()
    assert tune.variants("triton fwd", ("abc123", module)) == [(" @abc123", module, None), ("", None, None)]
    assert tune.variants("triton bwd", ("abc123", module))[0][1] is module
    assert tune.variants("cuda fwd", ("abc123", module)) == [("", None, None)]
    assert tune.variants("triton fwd", None) == [("", None, None)]
    # --against-csrc: the CUDA launchers twice, through NVRTC, from the revision's sources and then the checkout's
    assert tune.variants("cuda bwd", None, ("abc123", "/old/csrc")) == [(" @abc123", None, "/old/csrc"),
                                                                        ("", None, "")]
    assert tune.variants("triton fwd", None, ("abc123", "/old/csrc")) == [("", None, None)]


def test_against_csrc(tune, tmp_path, monkeypatch):
    """--against-csrc: csrc/ at a revision (git archive) or a directory holding a copy, and the NVRTC path's
    sources switched to it within csrc_sources (megakern._cuda.csrc_root), the checkout's outside; a revision that
    does not exist and a tree without the sources are clear errors."""
    from megakern import _cuda

    monkeypatch.delenv(_cuda.CSRC_ENV, raising=False)
    checkout = _cuda.csrc_root()
    root = tune.load_csrc("HEAD", str(tmp_path))
    assert Path(root) == tmp_path / "csrc" and (Path(root) / "norm" / "norm.cu").is_file()
    assert tune.load_csrc(str(tmp_path), str(tmp_path / "unused")) == str((tmp_path / "csrc").resolve())
    assert tune.load_csrc(root, str(tmp_path / "unused")) == str(Path(root).resolve())
    with tune.csrc_sources(root):
        assert _cuda.csrc_root() == Path(root).resolve()
        with tune.csrc_sources(""):
            assert _cuda.csrc_root() == checkout
        assert _cuda.csrc_root() == Path(root).resolve()
    assert _cuda.csrc_root() == checkout
    with pytest.raises(SystemExit, match="--against-csrc 'no-such-revision-x'"):
        tune.load_csrc("no-such-revision-x", str(tmp_path / "x"))
    monkeypatch.setenv(_cuda.CSRC_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="MEGAKERN_CSRC=.* is not a tree of megakern's kernel sources"):
        _cuda.csrc_root()


def test_against_unknown_revision(tune, tmp_path):
    with pytest.raises(SystemExit, match="--against 'no-such-revision-x'"):
        tune.load_revision("no-such-revision-x", str(tmp_path))


def test_against_a_copy_of_the_file(tune, tmp_path):
    from conftest import require_triton

    require_triton()
    copy = tmp_path / "norm_copy.py"
    copy.write_text((REPO / "megakern" / "_norm_triton.py").read_text())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    old = tune.load_revision(str(copy), str(scratch))
    assert old.__file__ == str(scratch / "_norm_triton_against.py") and hasattr(old, "_fwd_config")
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    with pytest.raises(SystemExit, match="not a copy of megakern/_norm_triton.py"):
        tune.load_revision(str(other), str(scratch))
    with pytest.raises(SystemExit, match="cannot read that file"):
        tune.load_revision(str(tmp_path / "missing.py"), str(scratch))
