"""Running megakern's CUDA C++ kernels: the built extension, or NVRTC through cupy.

Two paths reach the same kernel sources in csrc/:

- ``extension``: ``megakern._C``, built by ``python setup.py build_ext --inplace`` (pybind11, nvcc, sm_90a by
  default). Preferred when importable.
- ``nvrtc``: when the extension is not built, each kernel is compiled at first use by NVRTC through
  ``cupy.RawModule`` (about half a second a kernel, then cached on disk by cupy) and launched on torch's
  current stream. No build step at all.

``runtime()`` says which path is in use, or why neither is. Both take their launch geometry from the op's
Python launcher, so they run identical kernels with identical shapes.

Both are optional dependencies (contract 10, docs/contracts.md): an extension that does not load (not built, or built
against another torch) or was built from older sources (an entry point missing, or a ``__version__`` other than
megakern's) is passed over with the reason; cupy must be ``MIN_CUPY`` or later (``megakern._deps.optional_module``).
"""
from __future__ import annotations

import functools
import importlib
import os
import re
from pathlib import Path

import torch

PATHS = ("extension", "nvrtc")
MIN_CUPY = (13, 0)  # the NVRTC path's floor (pyproject.toml's nvrtc extra declares the same)
# What megakern's launchers call on megakern._C (csrc/bindings.cpp); a build that lacks one is from older sources.
ENTRY_POINTS = ("norm_fwd_rows", "norm_fwd_kernel_regs", "norm_bwd", "norm_bwd_kernel_regs", "fp8_cast", "rotary")
REBUILD = "python setup.py build_ext --inplace"


CSRC_ENV = "MEGAKERN_CSRC"  # another tree of kernel sources for the NVRTC path (an A/B of two versions)


def csrc_root() -> Path:
    """The kernel sources: the tree that MEGAKERN_CSRC names (the NVRTC path compiles from it; a copy of an older
    csrc/, for an A/B in one process), else a copy installed inside the package, or csrc/ of a source checkout.
    Read at every NVRTC kernel lookup, so it costs a dictionary lookup once the tree is known."""
    override = os.environ.get(CSRC_ENV)
    return _named_root(override) if override else _own_root()


@functools.lru_cache(maxsize=None)
def _named_root(override: str) -> Path:
    root = Path(override).resolve()
    if not (root / "common" / "common.h").is_file():
        raise FileNotFoundError(f"{CSRC_ENV}={override!r} is not a tree of megakern's kernel sources "
                                f"(no common/common.h there)")
    return root


@functools.lru_cache(maxsize=None)
def _own_root() -> Path:
    here = Path(__file__).resolve().parent
    for root in (here / "_csrc", here.parent / "csrc"):
        if (root / "common" / "common.h").is_file():
            return root
    raise FileNotFoundError(f"megakern's CUDA sources are missing: neither {here / '_csrc'} nor {here.parent / 'csrc'}")


@functools.lru_cache(maxsize=None)
def extension():
    """(module, '') if megakern._C loads and matches this megakern, else (None, reason)."""
    try:
        ext = importlib.import_module("megakern._C")
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "megakern._C":
            return None, f"megakern._C is not built ({exc}); run `{REBUILD}`"
        # e.g. undefined symbols: built against another torch or CUDA
        return None, (f"megakern._C does not load ({exc}): was it built against another torch or CUDA than this "
                      f"one (torch {torch.__version__})? rebuild it with `{REBUILD}`")
    import megakern

    where, built = getattr(ext, "__file__", "?"), getattr(ext, "__version__", None)
    if built is not None and built != megakern.__version__:
        return None, (f"megakern._C ({where}) was built for megakern {built}, this is megakern "
                      f"{megakern.__version__}; rebuild it with `{REBUILD}`")
    missing = [name for name in ENTRY_POINTS if not hasattr(ext, name)]
    if missing:
        return None, (f"megakern._C ({where}) lacks {', '.join(missing)}: it was built from older sources; rebuild "
                      f"it with `{REBUILD}`")
    return ext, ""


@functools.lru_cache(maxsize=None)
def _cupy():
    """(cupy, '') if a usable cupy is installed, else (None, reason)."""
    from megakern._deps import optional_module

    minimum = ".".join(map(str, MIN_CUPY))
    return optional_module("cupy", MIN_CUPY, "the NVRTC path of the CUDA kernels",
                           install=f"pip install -U 'cupy-cuda12x>={minimum}' (CUDA 12) or 'cupy-cuda13x>={minimum}' "
                                   "(CUDA 13)")


@functools.lru_cache(maxsize=None)
def runtime() -> tuple[str | None, str]:
    """('extension' | 'nvrtc', '') for the path in use, or (None, why neither works)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device is available to torch"
    ext, ext_problem = extension()
    if ext is not None:
        return "extension", ""
    cupy, cupy_problem = _cupy()
    if cupy is not None:
        return "nvrtc", ""
    return None, f"{ext_problem}; and the NVRTC fallback is unavailable: {cupy_problem}"


def choose_path(path: str | None = None) -> str:
    """The path to launch with: ``path`` if given (and available), else ``runtime()``'s."""
    if path is None:
        chosen, problem = runtime()
        if chosen is None:
            raise RuntimeError(f"megakern CUDA kernels are unavailable: {problem}")
        return chosen
    if path not in PATHS:
        raise ValueError(f"unknown CUDA path {path!r}; choose one of {PATHS}")
    problem = extension()[1] if path == "extension" else _cupy()[1]
    if problem:
        raise RuntimeError(f"CUDA path {path!r} is unavailable: {problem}")
    return path


def _inline_includes(path: Path, root: Path, seen: set[Path]) -> str:
    """The source with megakern's own quoted includes pasted in, so cupy's cache key covers all of it."""
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if m:
            target = (root / m.group(1)).resolve()
            if target not in seen:
                seen.add(target)
                out.append(_inline_includes(target, root, seen))
        elif not re.match(r"\s*#\s*pragma\s+once", line):
            out.append(line)
    return "\n".join(out)


def _cuda_include_dirs() -> list[str]:
    dirs = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            dirs.append(Path(os.environ[env]) / "include")
    dirs.append(Path("/usr/local/cuda/include"))
    cupy, _ = _cupy()
    if cupy is not None:
        try:
            dirs.append(Path(cupy.cuda.get_cuda_path()) / "include")
        except Exception:  # cupy cannot always name a toolkit; NVRTC's own headers may still do
            pass
    return [f"-I{d}" for d in dirs if (d / "cuda_bf16.h").is_file()]


def nvrtc_kernel(source: str, name: str, defines: tuple[str, ...] = ()):
    """The kernel ``name`` (a C++ name expression, e.g. 'megakern::norm_fwd_kernel<float, 2, 1, true>') of
    csrc/``source`` (of ``csrc_root()``); ``defines``: preprocessor definitions ('NAME=value') for the compile
    (tuning switches a source reads, such as csrc/norm/norm.cu's MEGAKERN_NORM_FWD_MAXNREG)."""
    return _nvrtc_kernel(csrc_root(), source, name, defines)


@functools.lru_cache(maxsize=None)
def _nvrtc_kernel(root: Path, source: str, name: str, defines: tuple[str, ...]):
    cupy, problem = _cupy()
    if cupy is None:
        raise RuntimeError(problem)
    code = _inline_includes(root / source, root, set())
    options = ("-std=c++17", *_cuda_include_dirs(), *(f"-D{d}" for d in defines))
    module = cupy.RawModule(code=code, options=options, name_expressions=(name,))
    return module.get_function(name)


def nvrtc_launch(kernel, grid: tuple, block: tuple, args: tuple, device: torch.device, shared_mem: int = 0) -> None:
    """Launch an NVRTC kernel on torch's current stream of ``device``, with ``shared_mem`` bytes of dynamic shared
    memory (above what the kernel may take by default, 48 KiB less its static shared memory, the kernel's limit is
    raised to it first)."""
    cupy, _ = _cupy()
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        if kernel.max_dynamic_shared_size_bytes < shared_mem:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        kernel(grid, block, args, shared_mem=shared_mem)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
