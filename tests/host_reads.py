"""Counting the places where host code reads device values (each one a host-device sync on a GPU).

On a CPU a sync cannot be observed, but what causes one can: ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``,
``torch.equal`` and friends go through aten ops that return a Python scalar (recorded by a dispatch mode), and
``.tolist()`` / ``.numpy()`` read a tensor's memory (recorded by wrapping them). On a GPU the same code is run under
``torch.cuda.set_sync_debug_mode("error")`` instead (see the tests marked gpu)."""
from __future__ import annotations

import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SCALAR_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
              aten.allclose.default}


class HostReads(TorchDispatchMode):
    """Records (what, where) for every read of a tensor's value by host code inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def _record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "host_reads.py" not in f.filename]
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in frames[-4:][::-1])
        self.reads.append((what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCALAR_OPS:
            self._record(str(func))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def watching(self):
        """The dispatch mode plus wrappers of Tensor.tolist / Tensor.numpy."""
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

        def wrap(name):
            def method(t, *args, **kwargs):
                self._record(f"Tensor.{name}")
                return originals[name](t, *args, **kwargs)
            return method

        try:
            for name in originals:
                setattr(torch.Tensor, name, wrap(name))
            with self:
                yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)


def host_reads(fn, *args, **kwargs) -> list[tuple[str, str]]:
    """Run fn(*args, **kwargs) and return the host reads of tensor values it made."""
    reads = HostReads()
    with reads.watching():
        fn(*args, **kwargs)
    return reads.reads
