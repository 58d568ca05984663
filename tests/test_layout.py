"""The floor plan's import rules, read from the sources with ast (nothing imported), so that a breach fails here:

- a kernel module (megakern/_*.py: kernels, launchers and their helpers) never imports a public op module of
  megakern: the op validates, allocates and dispatches, and hands tensors down;
- a kernel module (_<op>_triton.py, _<op>_gluon.py, _<op>_cuda.py) imports no other of megakern's private modules
  than the kernel-free helpers and the shared reduction (Triton and Gluon kernels of one op do not import each
  other: the op chooses between them);
- models/ and parallel/ use megakern's public API: no private megakern._* module but the documented shared helpers,
  and no private name of an op module (imported, or read as an attribute of the module or of ``megakern``).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {ROOT / "megakern": "megakern", ROOT / "parallel": "megakern.parallel", ROOT / "models": "megakern.models"}
OPS = ("rotary", "fp8", "attention", "layernorm", "rmsnorm", "linear", "activation", "cross_entropy", "optim")
OP_MODULES = {f"megakern.{op}" for op in OPS}
# private modules models/ and parallel/ may import: megakern/_checks.py says so in its docstring
SHARED_HELPERS = {"megakern._checks"}
# what a kernel module may import of megakern's private modules: kernel-free helpers, the shared row reduction, the
# shared rounding to a lower-precision dtype, and the Triton GEMMs' shared MMA step and launch helpers
KERNEL_HELPERS = {"megakern._intmath", "megakern._cuda", "megakern._reduce_triton", "megakern._round_triton",
                  "megakern._gemm_shared_triton"}


def _module_name(path: Path) -> str:
    for folder, package in PACKAGES.items():
        if folder in path.parents:
            parts = path.relative_to(folder).with_suffix("").parts
            return ".".join((package, *parts)).removesuffix(".__init__")
    raise ValueError(path)


def imports(path: Path) -> dict[str, int]:
    """Every module (and ``module.name`` for ``from module import name``) the file imports, anywhere in it (function
    bodies included), relative imports resolved as installed -> its first line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.setdefault(module, node.lineno)
            for alias in node.names:
                found.setdefault(f"{module}.{alias.name}", node.lineno)
    return found


def private_attributes(path: Path) -> list[tuple[str, int]]:
    """``module._name`` reads where ``module`` is a name the file binds to ``megakern`` or to an op module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "megakern" or alias.name in OP_MODULES:
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "megakern"
        elif isinstance(node, ast.ImportFrom) and node.module == "megakern" and not node.level:
            for alias in node.names:
                if f"megakern.{alias.name}" in OP_MODULES:
                    bound[alias.asname or alias.name] = f"megakern.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append((f"{bound[node.value.id]}.{node.attr}", node.lineno))
    return found


def _is_op_module(name: str) -> bool:
    return any(name == op or name.startswith(op + ".") for op in OP_MODULES)


def _private_module(name: str) -> str | None:
    """The megakern._* module ``name`` is or lies in, else None."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "megakern" and parts[1].startswith("_") and not parts[1].startswith("__"):
        return ".".join(parts[:2])
    return None


KERNEL_FILES = sorted(p for p in (ROOT / "megakern").glob("_*.py") if not p.name.startswith("__"))
CONSUMER_FILES = sorted((ROOT / "models").glob("*.py")) + sorted((ROOT / "parallel").glob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", KERNEL_FILES, ids=_rel)
def test_kernel_modules_do_not_import_ops(path):
    bad = sorted((line, name) for name, line in imports(path).items() if _is_op_module(name))
    assert not bad, f"{_rel(path)} imports public op modules (the op hands tensors down instead): " + ", ".join(
        f"line {line}: {name}" for line, name in bad)


@pytest.mark.parametrize("path", [p for p in KERNEL_FILES if re.fullmatch(r"_[a-z0-9_]+_(triton|gluon|cuda)", p.stem)],
                         ids=_rel)
def test_kernel_modules_import_only_shared_helpers(path):
    own = _module_name(path)
    bad = sorted((line, name) for name, line in imports(path).items()
                 if (module := _private_module(name)) and module != own and module not in KERNEL_HELPERS)
    allowed = ", ".join(sorted(KERNEL_HELPERS))
    assert not bad, f"{_rel(path)} imports other private modules of megakern (allowed: {allowed}): " + ", ".join(
        f"line {line}: {name}" for line, name in bad)


@pytest.mark.parametrize("path", CONSUMER_FILES, ids=_rel)
def test_models_and_parallel_use_public_apis(path):
    bad = []
    for name, line in imports(path).items():
        module = _private_module(name)
        if module and module not in SHARED_HELPERS:
            bad.append((line, f"{name} (a private module)"))
        elif _is_op_module(name) and name.rsplit(".", 1)[-1].startswith("_") and name not in OP_MODULES:
            bad.append((line, f"{name} (a private name of an op)"))
    for name, line in private_attributes(path):
        if _private_module(name) not in SHARED_HELPERS:
            bad.append((line, f"{name} (read as an attribute)"))
    assert not bad, f"{_rel(path)} uses megakern's private parts: " + ", ".join(
        f"line {line}: {what}" for line, what in sorted(bad))


def _read_as(reader, source: str, as_path: Path):
    """``reader`` on ``source`` as if it were the file ``as_path`` of the tree (its package), nothing written."""
    class Source(type(as_path)):
        def read_text(self, *args, **kwargs):
            return source
    return reader(Source(as_path))


def test_the_rules_see_violations():
    """The readers catch each form an offending import takes (the forms this floor plan removed)."""
    kernel = ROOT / "megakern" / "_probe_triton.py"
    source = ("from megakern.rotary import rotary_outputs\nfrom megakern import fp8\nfrom . import attention\n"
              "def f():\n    from megakern import _attention_gluon\n")
    found = _read_as(imports, source, kernel)
    assert {"megakern.rotary", "megakern.fp8", "megakern.attention", "megakern._attention_gluon"} <= set(found)
    assert all(_is_op_module(name) for name in ("megakern.rotary.rotary_outputs", "megakern.fp8", "megakern.attention"))
    assert _private_module("megakern._attention_gluon.fwd") == "megakern._attention_gluon"
    consumer = ROOT / "models" / "probe.py"
    source = ("import megakern\nfrom megakern import rotary\nx = rotary._LAUNCHERS\ny = megakern._backend\n"
              "z = megakern.__version__\n")
    assert {name for name, _ in _read_as(private_attributes, source, consumer)} == {"megakern.rotary._LAUNCHERS",
                                                                                  "megakern._backend"}
