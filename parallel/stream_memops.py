"""CUDA stream memory operations: a stream writes a 32-bit value to device memory, or waits until a 32-bit value
in device memory equals one (``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` of the driver API, through ctypes).

Both run in the stream's front end, not on the SMs: a rank can tell a peer that data is in place, and wait for the
peer's word, while a GEMM fills every SM (a signal kernel cannot start until the GEMM's blocks leave an SM free).
They are captured into CUDA graphs as memory-operation nodes. The write comes after a memory fence over the
stream's earlier work (the driver's default), so a peer that sees the value sees the data written before it.

``unavailable()`` is '' where they can be used (a CUDA build of torch, the driver's entry points found), else why
not, in a sentence. Nothing here holds state beyond the driver's two entry points, looked up once.
"""
from __future__ import annotations

import ctypes
import functools

import torch

# cuda.h: CUstreamWaitValue_flags, CUstreamWriteValue_flags
WAIT_VALUE_EQ = 0x1
WRITE_VALUE_DEFAULT = 0x0


@functools.lru_cache(maxsize=1)
def _driver():
    """(write, wait, why not): the driver's cuStreamWriteValue32 and cuStreamWaitValue32, or why they are missing."""
    if torch.version.cuda is None:
        return None, None, f"torch {torch.__version__} is not a CUDA build"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return None, None, f"the CUDA driver library cannot be loaded ({exc})"
    found = []
    for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        fn = None
        for symbol in (f"{name}_v2", name):  # the v2 entry points are the ones every platform enables
            try:
                fn = getattr(lib, symbol)
                break
            except AttributeError:
                continue
        if fn is None:
            return None, None, f"the CUDA driver has no {name}"
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        found.append(fn)
    return found[0], found[1], ""


def unavailable() -> str:
    """'' when the stream memory operations can be used here, else why not."""
    return _driver()[2]


def _check(result: int, what: str, address: int) -> None:
    if result != 0:
        raise RuntimeError(f"{what} at address {address:#x} failed with CUDA driver error {result}")


def write_value32(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Once ``stream``'s earlier work is done (and fenced), it writes ``value`` to the 32-bit word at the device
    ``address`` (this device's memory, or a peer's mapped into this process)."""
    write, _, why = _driver()
    if why:
        raise RuntimeError(f"write_value32: {why}")
    _check(write(ctypes.c_void_p(stream.cuda_stream), address, value, WRITE_VALUE_DEFAULT), "cuStreamWriteValue32",
           address)


def wait_value32(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """``stream``'s later work waits until the 32-bit word at the device ``address`` equals ``value``."""
    _, wait, why = _driver()
    if why:
        raise RuntimeError(f"wait_value32: {why}")
    _check(wait(ctypes.c_void_p(stream.cuda_stream), address, value, WAIT_VALUE_EQ), "cuStreamWaitValue32", address)
