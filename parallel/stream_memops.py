"""A CUDA stream memory operation: a stream writes a 32-bit value to device memory (the driver's
``cuStreamWriteValue32``, through ctypes, at a raw device address: torch's ``symm_mem.stream_write_value32_`` op
makes the same call, but on a tensor's element).

It runs in the stream's front end, not on the SMs: a rank can tell a peer that data is in place while a GEMM fills
every SM (a signal kernel cannot start until the GEMM's blocks leave an SM free). It is captured into CUDA graphs
as a memory-operation node. The write comes after a memory fence over the stream's earlier work (the driver's
default), so a peer that sees the value sees the data written before it. (The driver's matching wait,
cuStreamWaitValue32, is not used: on an H200 it ended 15-30 microseconds after the flag was set, where a waiting
kernel sees it at once.)

``unavailable()`` is '' where it can be used (a CUDA build of torch, the driver's entry point found), else why not,
in a sentence. Nothing here holds state beyond the driver's entry point, looked up once.
"""
from __future__ import annotations

import ctypes
import functools

import torch

# cuda.h: CUstreamWriteValue_flags
WRITE_VALUE_DEFAULT = 0x0


@functools.lru_cache(maxsize=1)
def _driver():
    """(the driver's cuStreamWriteValue32, '') or (None, why it is missing)."""
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is not a CUDA build"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return None, f"the CUDA driver library cannot be loaded ({exc})"
    for symbol in ("cuStreamWriteValue32_v2", "cuStreamWriteValue32"):  # v2: the one every platform enables
        fn = getattr(lib, symbol, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            return fn, ""
    return None, "the CUDA driver has no cuStreamWriteValue32"


def unavailable() -> str:
    """'' when ``write_value32`` can be used here, else why not."""
    return _driver()[1]


def write_value32(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Once ``stream``'s earlier work is done (and fenced), it writes ``value`` to the 32-bit word at the device
    ``address`` (this device's memory, or a peer's mapped into this process)."""
    write, why = _driver()
    if why:
        raise RuntimeError(f"write_value32: {why}")
    result = write(ctypes.c_void_p(stream.cuda_stream), address, value, WRITE_VALUE_DEFAULT)
    if result != 0:
        raise RuntimeError(f"cuStreamWriteValue32 at address {address:#x} failed with CUDA driver error {result}")
