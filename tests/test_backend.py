"""megakern/_backend.py: the order of choice (argument > kernel table > default) and the reasons given."""
import pytest
import torch
from conftest import HAS_CUDA

from megakern import _backend, available_backends


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
    assert _backend._version_tuple("3.6.0") == (3, 6)
    assert _backend._version_tuple("2.11.0+cu130") == (2, 11)
    assert _backend._version_tuple("3.0.0rc1") == (3, 0)


def test_defaults_are_known_backends():
    for op, table in _backend.DEFAULTS.items():
        limits = [limit for limit, _ in table]
        assert limits == sorted(limits) and limits[-1] >= 65536, op  # every hidden size has an order
        for _, order in table:
            assert order[-1] == "torch" and set(order) <= set(_backend.BACKENDS), op
            assert sorted(order) == sorted(table[0][1]), op  # every size offers the same backends
    assert _backend.default_order("layer_norm", 8192)[0] == "triton"
    assert _backend.default_order("layer_norm", 8193)[0] == "cuda"


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
