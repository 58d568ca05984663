"""megakern's build.

Pure Python everywhere (megakern, megakern.parallel from parallel/, megakern.models from models/). Where torch has
CUDA and nvcc is found, also the extension megakern._C from csrc/ (pybind11 + ninja through
torch.utils.cpp_extension), for sm_90a unless MEGAKERN_CUDA_ARCHS says otherwise (e.g. "90a;80").

    python setup.py build_ext --inplace            # the extension, in the source tree
    pip install --no-build-isolation -e .          # editable, with the extension where CUDA is present
    pip install .                                  # pure Python (build isolation hides torch)
    MEGAKERN_PURE_PYTHON=1 pip install --no-build-isolation -e .   # pure Python on purpose, even where CUDA is

Without the extension the CUDA kernels still run: they are compiled at run time by NVRTC through cupy, from the
sources copied into the package (megakern/_csrc).
"""
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE_DIRS = {"megakern": "megakern", "megakern.data": "megakern/data", "megakern.parallel": "parallel",
                "megakern.models": "models"}
KERNEL_SUFFIXES = {".cu", ".cuh", ".h"}


class build_py_with_kernels(build_py):
    """Copies the kernel sources into the built package, for the NVRTC path of installed copies."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "megakern" / "_csrc"
        for src in sorted((ROOT / "csrc").rglob("*")):
            if src.suffix in KERNEL_SUFFIXES:
                dst = target / src.relative_to(ROOT / "csrc")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)


def cuda_build():
    """(ext_modules, cmdclass additions, why-not): the extension where it can be built."""
    if os.environ.get("MEGAKERN_PURE_PYTHON") == "1":
        return [], {}, "MEGAKERN_PURE_PYTHON=1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}, "torch is not importable at build time (pip's build isolation? use --no-build-isolation)"
    if torch.version.cuda is None:
        return [], {}, f"torch {torch.__version__} has no CUDA"
    if CUDA_HOME is None:
        return [], {}, "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    archs = [a.strip() for a in os.environ.get("MEGAKERN_CUDA_ARCHS", "90a").replace(",", ";").split(";") if a.strip()]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    sources = ["csrc/bindings.cpp"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*/*.cu"))
    ext = CUDAExtension(
        "megakern._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "-std=c++17", "-lineinfo", *gencode]},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}, ""


ext_modules, cmdclass, why_not = cuda_build()
if why_not:
    print(f"megakern: pure-Python install ({why_not}); CUDA kernels will compile at run time via cupy NVRTC if present")

setup(
    name="megakern",
    version="0.1.0",
    description="Kernels, parallelism and models for training transformers at scale",
    packages=list(PACKAGE_DIRS),
    package_dir=PACKAGE_DIRS,
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "tiktoken>=0.5", "tokenizers>=0.19"],
    extras_require={
        "triton": ["triton>=3.0"],
        "nvrtc": ["cupy-cuda12x", "numpy"],
        "dev": ["pytest", "triton>=3.0", "nvtx", "tqdm"],
    },
    entry_points={"console_scripts": ["megakern-train=megakern.train:main"]},
    ext_modules=ext_modules,
    cmdclass={"build_py": build_py_with_kernels, **cmdclass},
    zip_safe=False,
)
