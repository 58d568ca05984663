"""Shared test machinery: devices and backends under test, and the error rule every kernel is held to.

On a machine without CUDA, Triton kernels run on CPU tensors through the interpreter (TRITON_INTERPRET=1, set
here before any kernel is defined) and tests marked ``gpu`` are skipped with the reason.
"""
from __future__ import annotations

import os
import zlib
from functools import partial
from pathlib import Path

# MEGAKERN_TEST_GPUS=N spreads pytest-xdist workers over N GPUs (worker i sees GPU i mod N only), set before torch
# initializes CUDA: a 4-GPU host runs the single-GPU suite four times as wide
_SPREAD = int(os.environ.get("MEGAKERN_TEST_GPUS", "0") or 0)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _SPREAD > 1 and _WORKER.startswith("gw") and "CUDA_VISIBLE_DEVICES" not in os.environ:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_WORKER[2:]) % _SPREAD)

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# pytest-xdist workers share the cores: each takes its share of torch's threads (and passes the cap on to the
# processes it starts), or 8 workers of 16 threads each on 16 cores spend their time switching
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    _threads = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(min(torch.get_num_threads(), _threads))

# Extra error allowed beyond 2x plain low-precision torch's, per dtype.
ATOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def attention_determinism(monkeypatch) -> list:
    """The ``deterministic`` argument of every megakern.attention call made while the test runs, in order (the calls
    still run)."""
    import megakern

    asked = []
    real = megakern.attention

    def spy(*args, **kwargs):
        asked.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)

    monkeypatch.setattr(megakern, "attention", spy)
    return asked


def seed(*key) -> None:
    """Seed torch's RNG from a test's own key (its name and parameters): fresh inputs per case, the same on every
    run and under any test order or worker split."""
    torch.manual_seed(zlib.crc32(repr(key).encode()))


def require_triton(device: torch.device = DEVICE) -> None:
    """Skip, saying why, where Triton kernels cannot run on ``device``."""
    import megakern

    problem = megakern.available_backends(device)["triton"]
    if problem:
        pytest.skip(f"Triton unavailable: {problem}")


def shared_data(*needed: str) -> Path:
    """$MEGAKERN_SHARED_DATA, else ../shared/data relative to the repository's root (holding each of ``needed``), or
    a skip saying it is absent. (A GPU machine that gets a copy of the tree alone gets the files as an ignored
    folder, e.g. .shared-data/, which scripts/device_check.sh exports.)"""
    here = Path(__file__)
    root = here.absolute().parents[1]  # the repository, as reached (through any symlink)
    given = [Path(os.environ["MEGAKERN_SHARED_DATA"])] if os.environ.get("MEGAKERN_SHARED_DATA") else []
    for candidate in (*given, here.resolve().parents[2] / "shared" / "data", root / ".." / "shared" / "data"):
        if all((candidate / name).exists() for name in needed):
            return candidate
    pytest.skip(f"../shared/data ({', '.join(needed)}) is absent: it comes with the project's shared files, "
                "not with a clone")


def sm90_lowering(module: str, call: str):
    """The Python literal printed by ``module.call`` (a test module's compile-for-sm_90 function) run with real
    Triton kernels (TRITON_INTERPRET=0) in a subprocess, as this process may interpret them. Skips where this Triton
    cannot compile for a target without a GPU.

    The subprocess is started once (a ``_Lowering`` server) and answers every call of this test process in turn: it
    imports torch, Triton and the test modules once instead of once a call (most of a call's time)."""
    import ast

    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this Triton has no ASTSource/GPUTarget: {exc}")
    global _LOWERING
    if _LOWERING is None or not _LOWERING.alive():
        _LOWERING = _Lowering()
    return ast.literal_eval(_LOWERING.ask(module, call, timeout=600))


_LOWERING = None  # this process's _Lowering server, started on first use

# The server: one request a line on stdin, (module, call) as JSON; one reply a line, {"out": print()'s text of
# module.call} or {"error": the traceback}, on the file descriptor it was started with. Anything else printed
# (Triton's warnings, a compiler's output) goes to stderr, a file.
_SERVER = """
import importlib, json, os, sys, traceback
sys.path.insert(0, {here!r})
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    module, call = json.loads(line)
    try:
        reply = {{"out": str(eval("t." + call, {{"t": importlib.import_module(module)}}))}}
    except BaseException:
        reply = {{"error": traceback.format_exc()}}
    sys.stdout.flush()
    replies.write(json.dumps(reply) + "\\n")
    replies.flush()
"""


class _Lowering:
    """A Python subprocess with TRITON_INTERPRET=0 that evaluates compile-for-sm_90 calls of the test modules."""

    def __init__(self):
        import atexit
        import subprocess
        import sys
        import tempfile

        here = os.path.dirname(os.path.abspath(__file__))
        self.log = tempfile.TemporaryFile(mode="w+")  # its stderr: read back when it fails
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER.format(here=here)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "TRITON_INTERPRET": "0"})
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, module: str, call: str, timeout: float) -> str:
        """``module.call``'s printed result; AssertionError with the traceback (or the server's last words)."""
        import json
        import select

        self.proc.stdin.write(json.dumps([module, call]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            why = f"gave no answer within {timeout:g} s" if not ready else f"exited {self.proc.returncode}"
            raise AssertionError(f"{module}.{call}: the sm_90 lowering process {why}:\n{self._stderr()}")
        reply = json.loads(line)
        assert "error" not in reply, f"{module}.{call}:\n{reply.get('error', '')[-3000:]}"
        return reply["out"]

    def _stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def kernel_variants() -> list[str]:
    """Implementations to test on DEVICE: 'torch', 'triton', and on a GPU each CUDA path ('cuda-extension',
    'cuda-nvrtc'). An unavailable one skips with the reason when used."""
    from megakern import _cuda

    return ["torch", "triton"] + ([f"cuda-{p}" for p in _cuda.PATHS] if HAS_CUDA else [])


def cuda_path_problem(path: str) -> str:
    from megakern import _cuda

    return _cuda.extension()[1] if path == "extension" else _cuda._cupy()[1]


def skip_interpreter_faults(variant: str, dtype: torch.dtype) -> None:
    """The Triton interpreter truncates fp32 -> bf16 casts (about half round wrong): bf16 results of Triton
    kernels are only meaningful on a GPU."""
    if variant == "triton" and not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("the Triton CPU interpreter rounds fp32->bf16 casts wrongly; bf16 Triton numerics run on the GPU")


def launchers_for(variant: str):
    """(fwd, bwd) launchers of one implementation, for megakern._norm.NormFunction; None for 'torch'."""
    if variant == "torch":
        return None
    if variant == "triton":
        import megakern

        problem = megakern.available_backends(DEVICE)["triton"]
        if problem:
            pytest.skip(f"Triton unavailable: {problem}")
        from megakern import _norm_triton

        return _norm_triton.fwd, _norm_triton.bwd
    path = variant.split("-", 1)[1]
    problem = cuda_path_problem(path)
    if problem:
        pytest.skip(f"CUDA path {path!r} unavailable: {problem}")
    from megakern import _norm_cuda

    return partial(_norm_cuda.fwd, path=path), partial(_norm_cuda.bwd, path=path)


def poison_cuda_allocator(nbytes: int) -> None:
    """Leave NaN in the memory torch's caching allocator hands out next, so unwritten outputs show up as NaN."""
    if HAS_CUDA:
        torch.empty(nbytes // 4 + 1024, dtype=torch.float32, device=DEVICE).fill_(float("nan"))


def assert_close_to_ref(name: str, out: torch.Tensor, truth: torch.Tensor, lowp: torch.Tensor, atol: float) -> None:
    """flash-attention's rule: max|out - truth| <= 2 * max|lowp - truth| + atol, where truth is the reference in
    fp64 and lowp is plain torch in the low precision. NaN / Inf never pass. The report names the worst elements."""
    assert out.shape == truth.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(truth.shape)}"
    out64, truth64, lowp64 = out.detach().double().cpu(), truth.detach().double().cpu(), lowp.detach().double().cpu()
    finite = torch.isfinite(out64)
    if not finite.all():
        idx = (~finite).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: {(~finite).sum().item()} non-finite values of {out64.numel()}, e.g. at {idx}")
    err = (out64 - truth64).abs()
    base = (lowp64 - truth64).abs().max().item() if lowp64.numel() else 0.0
    bound = 2 * base + atol
    worst = err.max().item() if err.numel() else 0.0
    if worst > bound:
        flat = err.flatten().topk(min(5, err.numel())).indices
        rows = []
        for i in flat.tolist():
            at = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), err.shape))
            rows.append(f"  at {at}: got {out64[at].item():.6g}, fp64 ref {truth64[at].item():.6g}, "
                        f"low-precision torch {lowp64[at].item():.6g}")
        raise AssertionError(f"{name}: max error {worst:.3g} > bound {bound:.3g} (2 x torch's {base:.3g} + atol "
                             f"{atol:g}); {(err > bound).sum().item()} of {err.numel()} elements over\n" + "\n".join(rows))
