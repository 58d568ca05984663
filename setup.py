"""megakern's CUDA extension, megakern._C; the package itself (metadata, dependencies, layout) is pyproject.toml's.

Where torch has CUDA and a CUDA toolkit (nvcc) is found, csrc/ is compiled into megakern._C (pybind11 + ninja
through torch.utils.cpp_extension) for sm_90a, or the architectures of MEGAKERN_CUDA_ARCHS (e.g. "90a;80"). Every
build also copies the kernel sources into the package (megakern/_csrc), from which installed copies compile the
kernels at run time through cupy's NVRTC when the extension is absent.

The extension is optional in an install and required where asked for by name:

    pip install --no-build-isolation -e .          # the extension where it builds; else pure Python, and one line why
    pip install -e .                               # pure Python: pip's build isolation hides torch
    python setup.py build_ext --inplace            # the extension, in the source tree, or an error
    MEGAKERN_REQUIRE_EXTENSION=1 pip install --no-build-isolation -e .   # the extension, or the install fails
    MEGAKERN_PURE_PYTHON=1 pip install --no-build-isolation -e .         # pure Python on purpose, even where CUDA is

An install that cannot build the extension (torch without CUDA, no nvcc, a compile or link error) succeeds as pure
Python and prints one line: the reason (the compiler's first error line, or the exception) and the file holding
the compiler's whole output. Where the extension is required, the compiler's output goes to the console and a
failure fails the command.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import setuptools
from setuptools import setup
from setuptools.command.build_py import build_py

MIN_SETUPTOOLS = 77  # pyproject.toml's SPDX `license` and `license-files` (PEP 639); build-system.requires says so too
if int(setuptools.__version__.split(".")[0]) < MIN_SETUPTOOLS:
    sys.exit(f"megakern: building needs setuptools>={MIN_SETUPTOOLS}, found {setuptools.__version__} at "
             f"{Path(setuptools.__file__).parent} (--no-build-isolation builds with the environment's own): "
             f"pip install -U 'setuptools>={MIN_SETUPTOOLS}'")

ROOT = Path(__file__).resolve().parent
KERNEL_SUFFIXES = {".cu", ".cuh", ".h"}  # what the NVRTC path reads (megakern/_cuda.py)
NVRTC_NOTE = "the CUDA kernels compile at run time through cupy's NVRTC where it is installed"
# A compiler's or linker's error line: gcc/clang "f.cpp:5:10: fatal error: ...", cicc "f.cu(12): error: ...",
# "nvcc fatal   : ...", ld "/usr/bin/ld: cannot find -lc10_cuda" and "undefined reference to ...".
ERROR_LINE = re.compile(r"\berror\s*[:(]|\bfatal\b|(^|/)ld(\.\w+)?: |undefined reference", re.IGNORECASE)


def env_flag(name: str) -> bool:
    """True for 1, False for 0 or unset; anything else is an error naming the variable."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        sys.exit(f"megakern: {name}={value!r} is not a flag: set it to 1 or 0, or unset it")
    return value == "1"


PURE = env_flag("MEGAKERN_PURE_PYTHON")
REQUIRED = env_flag("MEGAKERN_REQUIRE_EXTENSION") or "build_ext" in sys.argv[1:]
if PURE and REQUIRED:
    asked = "MEGAKERN_REQUIRE_EXTENSION=1" if env_flag("MEGAKERN_REQUIRE_EXTENSION") else "`setup.py build_ext`"
    sys.exit(f"megakern: MEGAKERN_PURE_PYTHON=1 and {asked} ask for opposite things; unset MEGAKERN_PURE_PYTHON")


def cuda_archs() -> list[str]:
    """MEGAKERN_CUDA_ARCHS ("90a;80", commas allowed) as a list, "90a" by default; a malformed entry is an error."""
    raw = os.environ.get("MEGAKERN_CUDA_ARCHS", "90a")
    archs = [a.strip() for a in raw.replace(",", ";").split(";") if a.strip()]
    bad = [a for a in archs if not re.fullmatch(r"\d{2,3}[af]?", a)]
    if bad or not archs:
        sys.exit(f"megakern: MEGAKERN_CUDA_ARCHS={raw!r}: expected compute capabilities such as '90a;80', got {bad}")
    return archs


def first_error(output: str, exc: BaseException) -> str:
    """The first compiler or linker error line of ``output`` or of the exception's text, else the exception."""
    for line in (output + "\n" + str(exc)).splitlines():
        if ERROR_LINE.search(line):
            return line.strip()[:400]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:400] if text else 'no message'}"


@contextlib.contextmanager
def output_to(path: Path):
    """File descriptors 1 and 2 (this process's and its compilers') go to ``path`` inside the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield log
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


class build_py_with_kernels(build_py):
    """Copies the kernel sources into the built package (megakern/_csrc), for the NVRTC path of installed copies;
    says in one line why an install is pure Python when the extension was not even attempted."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "megakern" / "_csrc"
        for src in sorted((ROOT / "csrc").rglob("*")):
            if src.suffix in KERNEL_SUFFIXES:
                dst = target / src.relative_to(ROOT / "csrc")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
        if WHY_NOT:
            print(f"megakern: pure-Python install ({WHY_NOT}); {NVRTC_NOTE}", flush=True)


def optional(build_ext_class):
    """``build_ext_class`` whose failure, unless the extension is REQUIRED, leaves a pure-Python install: the
    compiler's output goes to a log under the build directory and one line says why."""

    class build_ext(build_ext_class):
        def run(self):
            if REQUIRED:
                super().run()
                return
            # Outside the build directories, which pip deletes (editable and sdist builds); removed on success.
            fd, name = tempfile.mkstemp(prefix="megakern_C-build-", suffix=".log")
            os.close(fd)
            log = Path(name)
            try:
                with output_to(log):
                    super().run()
            except Exception as exc:  # a compile or link error, or torch's toolkit checks
                with log.open("a") as f:
                    f.write(traceback.format_exc())
                reason = first_error(log.read_text(errors="replace"), exc)
                self.extensions = []  # nothing to install or to copy back into the tree
                print(f"megakern: pure-Python install: the CUDA extension megakern._C did not build ({reason}; the "
                      f"compiler's output is in {log}); {NVRTC_NOTE}; MEGAKERN_REQUIRE_EXTENSION=1 makes this an error",
                      flush=True)
            else:
                log.unlink()

    return build_ext


def extension() -> tuple[list, dict, str]:
    """(ext_modules, cmdclass additions, why not): megakern._C where torch and a CUDA toolkit can build it."""
    if PURE:
        return [], {}, "MEGAKERN_PURE_PYTHON=1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as exc:  # ImportError, or a torch that fails to load its libraries
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [], {}, (f"torch is not importable at build time ({detail}); pip's build isolation hides an installed "
                        "torch: add --no-build-isolation")
    if torch.version.cuda is None:
        return [], {}, f"torch {torch.__version__} has no CUDA"
    if CUDA_HOME is None:
        return [], {}, "no CUDA toolkit found (nvcc on PATH, or CUDA_HOME)"
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in cuda_archs()]
    sources = ["csrc/bindings.cpp"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").glob("*/*.cu"))
    ext = CUDAExtension(
        "megakern._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "-std=c++17", "-lineinfo", *gencode]},
    )
    return [ext], {"build_ext": optional(BuildExtension.with_options(use_ninja=True))}, ""


EXT_MODULES, CMDCLASS, WHY_NOT = extension()
if WHY_NOT and REQUIRED:
    sys.exit(f"megakern: the CUDA extension megakern._C cannot be built here: {WHY_NOT}")

setup(ext_modules=EXT_MODULES, cmdclass={"build_py": build_py_with_kernels, **CMDCLASS})
