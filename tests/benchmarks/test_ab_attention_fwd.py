"""profiles/ab_attention_fwd.py without a GPU: a --base that is missing or not a copy of the Gluon module is a clear
error, and a copy of the module loads under a name of its own (the timing itself needs a Hopper GPU)."""
from pathlib import Path

import pytest

from benchmarks.common import import_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mod():
    return import_file(REPO / "profiles" / "ab_attention_fwd.py", "ab_attention_fwd")


def test_base_must_exist(mod, tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        mod.load(str(tmp_path / "missing.py"))


def test_base_must_be_the_module(mod, tmp_path):
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    with pytest.raises(SystemExit, match="not a copy of megakern/_attention_gluon.py"):
        mod.load(str(other))


def test_base_copy_loads(mod, tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text((REPO / "megakern" / "_attention_gluon.py").read_text())
    base = mod.load(str(copy))
    from megakern import _attention_gluon

    assert base is not _attention_gluon and base.__name__ == "base_attention_gluon" and callable(base.fwd)
