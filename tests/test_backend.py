"""megakern/_backend.py: the order of choice (argument > kernel table > default) and the reasons given; optional
dependencies (Triton, liger, cupy, the megakern._C extension) missing, shadowed, stale or too old are named with the
version found and the version needed (contract 10, docs/contracts.md)."""
import importlib.abc
import sys
import types

import pytest
import torch
from conftest import HAS_CUDA

import megakern
from megakern import _backend, _cuda, _deps, available_backends


def test_available_backends_reasons():
    status = available_backends("cpu")
    assert set(status) == set(_backend.BACKENDS)
    assert status["torch"] == ""
    assert "CUDA tensor" in status["cuda"]
    assert _backend.triton_problem(torch.device("meta")).startswith("Triton kernels do not run on meta")


def test_resolve_order():
    cpu = torch.device("cpu")
    assert _backend.resolve("rms_norm", cpu) == "torch"  # the reference is the CPU default
    assert _backend.resolve("rms_norm", cpu, "torch") == "torch"
    assert _backend.resolve("rms_norm", cpu, {"layer_norm": "cuda"}) == "torch"  # table without this op: default
    with pytest.raises(RuntimeError, match="rms_norm: backend 'cuda' is not available"):
        _backend.resolve("rms_norm", cpu, {"rms_norm": "cuda"})
    with pytest.raises(ValueError, match="unknown backend 'cudnn'"):
        _backend.resolve("rms_norm", cpu, "cudnn")
    with pytest.raises(ValueError, match="attention: unknown backend 'cuda'; choose one of torch, triton"):
        _backend.resolve("attention", cpu, "cuda")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in _backend.triton_problem(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _backend.triton_problem(torch.device("cpu")) in ("", _backend._triton_problem())


def test_version_parsing():
    assert _deps.version_tuple("3.6.0") == (3, 6)
    assert _deps.version_tuple("2.11.0+cu130") == (2, 11)
    assert _deps.version_tuple("3.0.0rc1") == (3, 0)
    assert _deps.version_tuple("0.17.0rc1", 3) == (0, 17, 0)
    assert _deps.version_tuple("13", 3) == (13, 0, 0)


def test_defaults_are_known_backends():
    for op, table in _backend.DEFAULTS.items():
        limits = [limit for limit, _ in table]
        assert limits == sorted(limits) and limits[-1] >= 65536, op  # every hidden size has an order
        for _, order in table:
            # the reference last, unless 'torch' is torch's own kernel (TORCH_KERNEL_OPS)
            assert order[-1] == "torch" or op in _backend.TORCH_KERNEL_OPS, op
            assert "torch" in order and set(order) <= set(_backend.BACKENDS), op
            assert sorted(order) == sorted(table[0][1]), op  # every size offers the same backends
    assert _backend.default_order("layer_norm", 8192)[0] == "triton"
    assert _backend.default_order("rms_norm", 1 << 16)[0] == "triton"  # wide rows too: the two-pass backward


@pytest.mark.gpu
def test_cuda_default_is_available_backend():
    dev = torch.device("cuda")
    for size in (1024, 65536):
        chosen = _backend.resolve("rms_norm", dev, size=size)
        assert available_backends(dev)[chosen] == ""
        assert chosen == next(b for b in _backend.default_order("rms_norm", size) if not available_backends(dev)[b])
    assert HAS_CUDA


def test_launch_integer_helpers_match_triton():
    """The launchers' plain-Python cdiv / next_power_of_2 give Triton's values (sizes, grids and block widths)."""
    triton = pytest.importorskip("triton")
    from megakern._intmath import cdiv, next_power_of_2

    sizes = list(range(0, 2100)) + [2 ** e + d for e in range(11, 40) for d in (-1, 0, 1)]
    for n in sizes:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 128, 1000):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)


def test_backend_probes_are_constants_under_torch_compile(monkeypatch):
    """Traced by Dynamo, a probe's failed import (megakern._C not built) is an exception it cannot handle: the graph
    broke inside every op's backend choice, and around an autograd Function that broke AOTAutograd's backward
    (seen with the CUDA rotary ops on a GPU without the extension). The probes run eagerly and are constants to
    torch.compile: a whole graph compiles."""
    def probe(device):
        try:
            from megakern import _not_built  # noqa: F401  (what extension() meets without megakern._C)
        except ImportError as exc:
            return f"not built ({exc})"
        return ""

    monkeypatch.setattr(_backend, "cuda_problem", probe)
    _backend._cuda_device_backends.cache_clear()
    try:
        def f(x):
            problems = available_backends(torch.device("cuda", 0))
            return x + (1.0 if problems["cuda"] else 2.0) + (0.5 if available_backends(x.device)["cuda"] else 0.0)

        torch.compiler.reset()
        out = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(3))
        assert torch.equal(out, torch.full((3,), 2.5))
    finally:
        _backend._cuda_device_backends.cache_clear()
        torch.compiler.reset()


# ---- optional dependencies: missing, shadowed or too old, named with the version found and needed (contract 10) ----
def _module(name: str, version: str | None = None, **attrs) -> types.ModuleType:
    """A stand-in for an installed package: a module with a file (and a version, and ``attrs``)."""
    mod = types.ModuleType(name)
    mod.__file__ = f"/site-packages/{name}/__init__.py"
    if version is not None:
        mod.__version__ = version
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


@pytest.fixture
def fresh_probes(monkeypatch):
    """The probes' caches emptied before and after: they answer for the modules the test puts in place."""
    def clear():
        for probe in (_backend._triton_problem, _backend._cuda_device_backends, _cuda.extension, _cuda._cupy,
                      _cuda.runtime):
            probe.cache_clear()

    clear()
    yield monkeypatch
    clear()


def test_missing_shadowed_or_old_triton_is_named(fresh_probes):
    monkeypatch = fresh_probes
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    floor = ".".join(map(str, _backend.MIN_TRITON))
    monkeypatch.setitem(sys.modules, "triton", None)  # not installed
    problem = available_backends(cpu)["triton"]
    assert f"triton>={floor} is needed for megakern's Triton kernels but cannot be imported (ModuleNotFound" in problem
    assert problem.endswith(f"pip install -U 'triton>={floor}'")
    with pytest.raises(RuntimeError, match=rf"rms_norm: backend 'triton' is not available: .*triton>={floor}"):
        _backend.resolve("rms_norm", cpu, "triton")
    _backend._triton_problem.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", _module("triton", "3.5.1"))
    assert _backend.triton_problem(cpu) == (f"triton>={floor} is needed for megakern's Triton kernels, found triton "
                                            f"3.5.1 (/site-packages/triton/__init__.py); pip install -U "
                                            f"'triton>={floor}'")
    _backend._triton_problem.cache_clear()
    shadow = types.ModuleType("triton")
    shadow.__path__ = ["/home/me/triton"]  # a folder named triton on the path: a namespace package, no __file__
    monkeypatch.setitem(sys.modules, "triton", shadow)
    assert "'import triton' found a folder without the package (/home/me/triton)" in _backend.triton_problem(cpu)
    _backend._triton_problem.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", _module("triton", f"{floor}.0+git1a2b3c"))
    assert _backend.triton_problem(cpu) == ""


def test_liger_floor_reads_the_distribution_version(fresh_probes, monkeypatch):
    """liger_kernel has no __version__: the installed distribution's version is compared."""
    floor = ".".join(map(str, _backend.MIN_LIGER))
    monkeypatch.setitem(sys.modules, "liger_kernel", _module("liger_kernel"))
    monkeypatch.setattr(_deps.importlib.metadata, "version", lambda name: {"liger_kernel": "0.4.2"}[name])
    assert _backend.liger_problem() == (f"liger_kernel>={floor} is needed for the liger provider, found liger_kernel "
                                        f"0.4.2 (/site-packages/liger_kernel/__init__.py); pip install -U "
                                        f"'liger_kernel>={floor}'")
    monkeypatch.setattr(_deps.importlib.metadata, "version", lambda name: "0.8.5")
    assert _backend.liger_problem() == ""

    def not_installed(name):
        raise _deps.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_deps.importlib.metadata, "version", not_installed)
    assert "the version of liger_kernel (/site-packages/liger_kernel/__init__.py) cannot be read" in \
        _backend.liger_problem()
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    assert f"liger_kernel>={floor} is needed for the liger provider but cannot be imported" in _backend.liger_problem()


def test_missing_or_old_cupy_is_named(fresh_probes, monkeypatch):
    floor = ".".join(map(str, _cuda.MIN_CUPY))
    monkeypatch.setitem(sys.modules, "megakern._C", None)  # no extension: the NVRTC path is the only one
    monkeypatch.setitem(sys.modules, "cupy", None)
    cupy, problem = _cuda._cupy()
    assert cupy is None and f"cupy>={floor} is needed for the NVRTC path of the CUDA kernels but cannot" in problem
    assert f"pip install -U 'cupy-cuda12x>={floor}' (CUDA 12) or 'cupy-cuda13x>={floor}' (CUDA 13)" in problem
    _cuda._cupy.cache_clear()
    monkeypatch.setitem(sys.modules, "cupy", _module("cupy", "12.3.0"))
    with pytest.raises(RuntimeError, match=rf"CUDA path 'nvrtc' is unavailable: cupy>={floor} is needed for .*, found "
                                           r"cupy 12.3.0 \(/site-packages/cupy/__init__.py\)"):
        _cuda.choose_path("nvrtc")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path, why = _cuda.runtime()
    assert path is None and why.startswith("megakern._C is not built")
    assert "and the NVRTC fallback is unavailable: " in why and "found cupy 12.3.0" in why
    _cuda._cupy.cache_clear(), _cuda.runtime.cache_clear()
    monkeypatch.setitem(sys.modules, "cupy", _module("cupy", "13.6.0"))
    assert _cuda.runtime() == ("nvrtc", "")


def test_extension_not_built_stale_or_for_another_torch(fresh_probes, monkeypatch):
    complete = {name: (lambda *args: None) for name in _cuda.ENTRY_POINTS}
    monkeypatch.setitem(sys.modules, "megakern._C", None)
    assert _cuda.extension()[1].startswith("megakern._C is not built")
    with pytest.raises(RuntimeError, match="CUDA path 'extension' is unavailable: megakern._C is not built .*"
                                           "python setup.py build_ext --inplace"):
        _cuda.choose_path("extension")
    _cuda.extension.cache_clear()
    stale = _module("megakern._C", **{k: v for k, v in complete.items() if k not in ("fp8_cast", "rotary")})
    monkeypatch.setitem(sys.modules, "megakern._C", stale)
    assert _cuda.extension() == (None, "megakern._C (/site-packages/megakern._C/__init__.py) lacks fp8_cast, rotary: "
                                       "it was built from older sources; rebuild it with `python setup.py build_ext "
                                       "--inplace`")
    _cuda.extension.cache_clear()
    monkeypatch.setitem(sys.modules, "megakern._C", _module("megakern._C", "0.0.1", **complete))
    assert f"was built for megakern 0.0.1, this is megakern {megakern.__version__}" in _cuda.extension()[1]
    _cuda.extension.cache_clear()
    ext = _module("megakern._C", **complete)
    monkeypatch.setitem(sys.modules, "megakern._C", ext)
    assert _cuda.extension() == (ext, "")

    class OtherTorch(importlib.abc.MetaPathFinder):
        """Finds megakern._C and fails to load it, as a build against another torch does."""

        def find_spec(self, name, path, target=None):
            if name == "megakern._C":
                raise ImportError("megakern/_C.so: undefined symbol: _ZN3c1015SmallVectorBaseIjE8grow_podEPKvmm")
            return None

    _cuda.extension.cache_clear()
    monkeypatch.delitem(sys.modules, "megakern._C")
    monkeypatch.setattr(sys, "meta_path", [OtherTorch(), *sys.meta_path])
    module, why = _cuda.extension()
    assert module is None and "megakern._C does not load (megakern/_C.so: undefined symbol: " in why
    assert f"built against another torch or CUDA than this one (torch {torch.__version__})" in why


def test_nvrtc_kernels_compile_from_the_named_sources(monkeypatch, tmp_path):
    """The NVRTC path compiles from csrc/, or from the tree MEGAKERN_CSRC names (an A/B of two versions in one
    process): each tree's kernel compiled once and cached by its tree, a tree without the sources named."""
    import shutil

    compiled = []

    class RawModule:  # cupy's, recording what it is asked to compile
        def __init__(self, code, options, name_expressions):
            compiled.append(code)
            self.code = code

        def get_function(self, name):
            return (name, self.code)

    fake = types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(get_cuda_path=lambda: "/none"))
    monkeypatch.setattr(_cuda, "_cupy", lambda: (fake, ""))
    _cuda._nvrtc_kernel.cache_clear()
    monkeypatch.delenv(_cuda.CSRC_ENV, raising=False)
    name = "megakern::fp8_cast_kernel"
    own = _cuda.nvrtc_kernel("fp8/fp8.cu", name)
    other = tmp_path / "csrc"
    shutil.copytree(_cuda.csrc_root(), other)
    (other / "fp8" / "fp8.cu").write_text((other / "fp8" / "fp8.cu").read_text() + "\n// the other version\n")
    monkeypatch.setenv(_cuda.CSRC_ENV, str(other))
    assert _cuda.csrc_root() == other.resolve()
    theirs = _cuda.nvrtc_kernel("fp8/fp8.cu", name)
    assert "// the other version" in theirs[1] and "// the other version" not in own[1]
    assert _cuda.nvrtc_kernel("fp8/fp8.cu", name) is theirs and len(compiled) == 2
    monkeypatch.delenv(_cuda.CSRC_ENV)
    assert _cuda.nvrtc_kernel("fp8/fp8.cu", name) is own and len(compiled) == 2
    monkeypatch.setenv(_cuda.CSRC_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="is not a tree of megakern's kernel sources"):
        _cuda.nvrtc_kernel("fp8/fp8.cu", name)
    _cuda._nvrtc_kernel.cache_clear()
