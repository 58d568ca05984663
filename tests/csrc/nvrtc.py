"""A minimal ctypes binding of NVRTC, so the kernel sources' NVRTC path is checked on machines with no GPU.

Finds libnvrtc from the nvidia-cuda-nvrtc wheel, CUDA_HOME / CUDA_PATH, or the system; compiles to PTX only.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import site
import sys


def find_libnvrtc() -> str | None:
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    patterns = [f"{r}/nvidia/cu13/lib/libnvrtc.so.*" for r in roots]
    patterns += [f"{r}/nvidia/cuda_nvrtc/lib/libnvrtc.so.*" for r in roots]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            patterns.append(f"{os.environ[env]}/lib64/libnvrtc.so*")
    patterns.append("/usr/local/cuda/lib64/libnvrtc.so*")
    for pattern in patterns:
        hits = sorted(p for p in glob.glob(pattern) if "builtins" not in p and "alt" not in p)
        if hits:
            return hits[0]
    return ctypes.util.find_library("nvrtc")


def compile_ptx(code: str, name_expressions: list[str], options: list[str]) -> tuple[bool, str]:
    """(ok, log) after compiling ``code`` with every name expression instantiated."""
    path = find_libnvrtc()
    # libnvrtc dlopens its builtins library by name; load it from the same folder first
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
        if "alt" not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"kernel.cu", 0, None, None) == 0
    try:
        for name in name_expressions:
            assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        return status == 0, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
