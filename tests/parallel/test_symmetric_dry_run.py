"""The symmetric-memory ops of parallel.overlap run on the CPU against fakes of what needs a GPU: each rank a thread,
a symmetric allocation a CPU tensor per rank that every rank maps (``get_buffer`` of any rank), a signal a semaphore
(``put_signal`` releases the peer's, ``wait_signal`` takes this rank's, with a timeout), CUDA streams and events that
record which stream's work the current stream has joined. Each rank runs its streams' work in program order, so the
data a wait guards must have been written before the matching signal in program order: what the GPU's concurrent
streams may reorder is not modelled. (A pulled all-gather at more than 2 ranks waits for each peer on the peer's
own stream; run in one order those waits deadlock, so it runs at 2 ranks only.)

What it checks, for GEMM + reduce-scatter and all-gather + GEMM forward and backward, three calls with a growing
shape (both buffers of each role used, grown), every route, gather and number of runs of rows, the joins at each op
and deferred (``defer_joins``), at 2, 3 and 4 ranks:
- the output and the gradients equal the fp64 truth (the fakes move data exactly);
- every signal sent is waited for, once (no semaphore left raised);
- every stream the ops forked is joined into the current stream by the end of the step (as a CUDA-graph capture
  requires), and with ``defer_joins`` some are still open before ``end_step``."""
import contextlib
import threading

import pytest
import torch

from megakern.parallel import overlap, symmetric

TIMEOUT = 20


class _Shared:
    """What the ranks of one run share: the allocations by rendezvous order, the signals, a barrier."""

    def __init__(self, n: int):
        self.n, self.lock, self.allocs, self.sems, self.pending = n, threading.Lock(), {}, {}, {}
        self.barrier = threading.Barrier(n)

    def _sem(self, key) -> threading.Semaphore:
        with self.lock:
            return self.sems.setdefault(key, threading.Semaphore(0))

    def signal(self, key) -> None:
        with self.lock:
            self.pending[key] = self.pending.get(key, 0) + 1
        self._sem(key).release()

    def wait(self, key) -> bool:
        if not self._sem(key).acquire(timeout=TIMEOUT):
            return False
        with self.lock:
            self.pending[key] -= 1
        return True

    def raised(self) -> list:
        """The signals sent and not (yet) waited for."""
        return [key for key, count in self.pending.items() if count]


class _Handle:
    def __init__(self, shared: _Shared, key: int, buffers: list, local):
        self.shared, self.key, self.buffers, self.local = shared, key, buffers, local
        self.signal_pad_size = 4096

    def get_buffer(self, rank, shape, dtype, offset):
        numel = 1
        for s in shape:
            numel *= s
        return self.buffers[rank].view(dtype)[offset:offset + numel].view(shape)

    def put_signal(self, peer, channel=0):
        self.shared.signal((self.key, peer, channel, self.local.rank))

    def wait_signal(self, peer, channel=0):
        if not self.shared.wait((self.key, self.local.rank, channel, peer)):
            raise TimeoutError(f"rank {self.local.rank} waited {TIMEOUT} s for rank {peer}'s signal on channel "
                               f"{channel}")

    def barrier(self, channel=0):
        self.shared.barrier.wait(timeout=TIMEOUT)


class _Stream:
    def __init__(self, side: bool = True):
        self.side, self.dirty, self.joined = side, 0, 0

    def wait_event(self, event):
        if event.stream is not self:
            event.stream.joined = max(event.stream.joined, event.mark)

    def wait_stream(self, stream):
        stream.joined = stream.dirty


class _Fakes:
    """torch.cuda's streams and events, and symmetric memory, for the rank of the calling thread."""

    def __init__(self, shared: _Shared):
        self.shared, self.local = shared, threading.local()

    def rank_init(self, rank: int):
        self.local.rank, self.local.calls, self.local.streams = rank, 0, []
        self.local.current = _Stream(side=False)

    # symmetric memory
    def empty(self, size, dtype, device):
        return torch.zeros(size, dtype=dtype)

    def rendezvous(self, tensor, group):
        self.local.calls += 1
        key = self.local.calls
        with self.shared.lock:
            buffers = self.shared.allocs.setdefault(key, [None] * self.shared.n)
            buffers[self.local.rank] = tensor
        self.shared.barrier.wait(timeout=TIMEOUT)
        return _Handle(self.shared, key, buffers, self.local)

    # torch.cuda
    def stream_new(self, device=None):
        stream = _Stream()
        self.local.streams.append(stream)
        return stream

    def event_new(self, *args, **kwargs):
        fakes = self

        class _Event:
            def record(self, stream=None):
                self.stream = stream if stream is not None else fakes.local.current
                self.mark = self.stream.dirty

        return _Event()

    @contextlib.contextmanager
    def stream_context(self, stream):
        before, self.local.current = self.local.current, stream
        stream.dirty += 1
        try:
            yield
        finally:
            self.local.current = before

    def open_streams(self) -> int:
        return sum(s.joined < s.dirty for s in self.local.streams)


@pytest.fixture
def fakes(monkeypatch):
    def install(n: int) -> _Fakes:
        f = _Fakes(_Shared(n))
        monkeypatch.setattr(symmetric, "symmetric_memory_usable", lambda group, device: "")
        monkeypatch.setattr(symmetric, "group_size", lambda group: n)
        monkeypatch.setattr(symmetric, "group_rank", lambda group: f.local.rank)
        from torch.distributed import _symmetric_memory as symm_mem

        monkeypatch.setattr(symm_mem, "empty", f.empty)
        monkeypatch.setattr(symm_mem, "rendezvous", f.rendezvous)
        monkeypatch.setattr(symm_mem, "set_backend", lambda name: None)
        monkeypatch.setattr(torch.cuda, "Stream", f.stream_new)
        monkeypatch.setattr(torch.cuda, "Event", f.event_new)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: f.local.current)
        monkeypatch.setattr(torch.cuda, "stream", f.stream_context)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        return f

    return install


def _rank(f: _Fakes, rank: int, n: int, settings: dict, data: list, out: dict) -> None:
    f.rank_init(rank)
    ws = symmetric.SymmetricWorkspace(None, torch.device("cpu", 0))
    ws.signals = "kernel"  # torch's signal kernels: here the fakes' semaphores (a stream write needs the driver)
    for key, value in settings.items():
        setattr(ws, key, value)
    errors, open_before_end = [], []
    for X, W, DY, Xc, Wc, DYc in data:  # x (n S, n K): rank r holds columns r K..; the column op's x: rank r's rows
        S, K, N = X.shape[0] // n, X.shape[1] // n, W.shape[0]
        cols, rows = slice(rank * K, (rank + 1) * K), slice(rank * S, (rank + 1) * S)
        x, w = X[:, cols].clone().requires_grad_(), W[:, cols].clone().requires_grad_()
        y = overlap._SymmGemmReduceScatter.apply(x, w, None, ws)
        y.backward(DY[rows])
        xs, wc = Xc[rows].clone().requires_grad_(), Wc[rank * N:(rank + 1) * N].clone().requires_grad_()
        yc = overlap._SymmAllGatherGemm.apply(xs, wc, None, ws)
        dyc = DYc[:, rank * N:(rank + 1) * N]
        yc.backward(dyc)
        want = [(y, (X @ W.t())[rows]), (x.grad, DY @ W[:, cols]), (w.grad, DY.t() @ X[:, cols]),
                (yc, Xc @ wc.t()), (xs.grad, (DYc @ Wc)[rows]), (wc.grad, dyc.t() @ Xc)]
        errors.append(max((got - ref).abs().max().item() for got, ref in want))
        open_before_end.append(f.open_streams())
        ws.end_step()
    out[rank] = (errors, open_before_end, f.open_streams(), ws.grown)


def _data(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for S, K, N in ((5, 6, 7), (9, 6, 7), (9, 8, 12)):  # grows every role's buffers
        r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
        out.append((r(n * S, n * K), r(N, n * K), r(n * S, N), r(n * S, K), r(n * N, K), r(n * S, n * N)))
    return out


CASES = [  # n, workspace settings
    (2, {}), (2, {"gather": "pull"}), (2, {"gather": "pull", "defer_joins": True, "rs_pieces": 3}),
    (2, {"defer_joins": True}), (2, {"rs_pieces": 1, "rs_route": "partials"}),
    (2, {"rs_route": "inputs", "defer_joins": True, "rs_pieces": 4}), (3, {}),
    (3, {"defer_joins": True, "rs_pieces": 3}), (3, {"rs_route": "inputs"}), (4, {"defer_joins": True}),
]


@pytest.mark.parametrize("n, settings", CASES, ids=[f"n{n}-" + ",".join(f"{k}={v}" for k, v in s.items())
                                                    for n, s in CASES])
def test_symmetric_ops_dry_run(fakes, n, settings):
    f = fakes(n)
    data, out = _data(n, 10 + n), {}
    failures = []

    def run(rank):
        try:
            _rank(f, rank, n, settings, data, out)
        except BaseException as e:  # reported below, with the rank
            failures.append((rank, repr(e)))
            f.shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * TIMEOUT)
    assert not failures, failures
    assert sorted(out) == list(range(n)), f"ranks that finished: {sorted(out)}"
    assert not f.shared.raised(), f"signals sent and never waited for: {f.shared.raised()}"
    for rank, (errors, open_before_end, open_after, grown) in out.items():
        assert max(errors) < 1e-9, f"rank {rank}: errors {errors}"
        assert open_after == 0, f"rank {rank}: {open_after} streams not joined after end_step"
        assert grown >= 6, f"rank {rank}: {grown} allocations (both buffers of each role, and their growth)"
        if settings.get("defer_joins"):
            assert min(open_before_end) > 0, f"rank {rank}: nothing deferred ({open_before_end})"
        else:
            assert max(open_before_end) == 0, f"rank {rank}: streams open before end_step ({open_before_end})"
