"""csrc/: every .cu compiles with nvcc for sm_90a, and every kernel instance the launchers can ask for compiles
with NVRTC (the extension-free path), on machines with no GPU. Skips with the reason where a compiler is missing."""
import math
import shutil
import subprocess

import pytest
import torch
from nvrtc import compile_ptx, find_libnvrtc

from megakern import _cuda, _fp8_cuda, _norm_cuda, _rotary_cuda

CSRC = _cuda.csrc_root()
SOURCES = sorted(CSRC.glob("*/*.cu"))


def test_kernel_sources_are_torch_free():
    for path in [*SOURCES, *CSRC.glob("*/*.h")]:
        text = path.read_text()
        assert "torch/" not in text and "ATen/" not in text and "c10/" not in text, f"{path} includes torch headers"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(CSRC)))
def test_nvcc_compiles_for_sm90a(source, tmp_path):
    """Host and device code through nvcc's whole chain, ptxas included (it checks the inline PTX). Device code at
    -O1 (cicc and ptxas), about half of -O3's time; -O3's code generation is the extension build's (setup.py) on
    the GPU machines."""
    cmd = ["nvcc", "-std=c++17", "-O3", f"-I{CSRC}", "-gencode=arch=compute_90a,code=sm_90a", "-Xcicc", "-O1",
           "-Xptxas", "-O1", "-Xptxas", "-v", "-c", str(source), "-o", str(tmp_path / "out.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "bytes spill stores" in proc.stderr


def _samples(names: list[str]) -> list[str]:
    """The first and the last instance of each kernel template and first template argument (the dtype)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.split(",")[0], []).append(name)
    return sorted({n for group in groups.values() for n in (group[0], group[-1])})


@pytest.mark.skipif(find_libnvrtc() is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("source, host", [("norm/norm.cu", _norm_cuda), ("rotary/rotary.cu", _rotary_cuda),
                                          ("fp8/fp8.cu", _fp8_cuda)], ids=["norm", "rotary", "fp8"])
def test_nvrtc_compiles_every_kernel_instance(source, host):
    """Every kernel instance the op's launcher can ask for compiles with NVRTC (the extension-free path).

    Every instance goes through NVRTC's front end: its name expression parsed and instantiated, the template body
    checked (-dlto: LTO IR for sm_90a, without the optimizer and code generation: seconds for all of norm.cu's
    instances, where PTX for all of them takes minutes). The first and last instance of each template and dtype go on to PTX, as a launch compiles
    them; test_nvcc_compiles_for_sm90a generates code for the same kernel bodies with nvcc, through ptxas."""
    code = _cuda._inline_includes(CSRC / source, CSRC, set())
    names, includes = host.kernel_names(), _cuda._cuda_include_dirs()
    ok, log = compile_ptx(code, names, ["-std=c++17", "-arch=sm_90a", "-dlto", *includes])
    assert ok, log[-4000:]
    ok, log = compile_ptx(code, _samples(names), ["-std=c++17", "-arch=compute_90a", *includes])
    assert ok, log[-4000:]


@pytest.mark.skipif(find_libnvrtc() is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc)")
def test_nvrtc_front_end_pass_catches_a_bad_instance():
    """The front-end pass above fails on a name that is no kernel and on a body that does not compile for one
    instance only (a static_assert that only NV = 4 with 16-bit rows trips)."""
    code = _cuda._inline_includes(CSRC / "norm/norm.cu", CSRC, set())
    opts = ["-std=c++17", "-arch=sm_90a", "-dlto", *_cuda._cuda_include_dirs()]
    ok, log = compile_ptx(code, ["megakern::no_such_kernel<float>"], opts)
    assert not ok and "no_such_kernel" in log, log[-2000:]
    marker = "constexpr int VEC = 16 / sizeof(T);"
    assert marker in code
    broken = code.replace(marker, marker + " static_assert(NV != 4 || sizeof(T) != 2, \"one instance\");", 1)
    ok, log = compile_ptx(broken, _norm_cuda.kernel_names(), opts)
    assert not ok and "one instance" in log, log[-2000:]
    assert _samples(["k<float, 1>", "k<float, 2>", "k<float, 3>", "k<__half, 1>", "j<float, 1>"]) == \
        ["j<float, 1>", "k<__half, 1>", "k<float, 1>", "k<float, 3>"]


@pytest.mark.skipif(find_libnvrtc() is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc)")
def test_nvrtc_compiles_rotary_under_a_register_cap():
    """The rotary kernel's tuning cap (MEGAKERN_ROTARY_MAXNREG, LaunchConfig.max_registers) compiles with NVRTC, as
    a launch with that config compiles it."""
    code = _cuda._inline_includes(CSRC / "rotary/rotary.cu", CSRC, set())
    names = [_rotary_cuda.kernel_name(torch.bfloat16, True, il, 2, items) for il in (False, True) for items in (2, 4)]
    ok, log = compile_ptx(code, names, ["-std=c++17", "-arch=compute_90a", "-DMEGAKERN_ROTARY_MAXNREG=64",
                                        *_cuda._cuda_include_dirs()])
    assert ok, log[-4000:]


def test_rotary_register_cap_is_checked():
    assert _rotary_cuda.LaunchConfig(128, 4, 1, max_registers=64).max_registers == 64
    for bad in (8, 256):
        with pytest.raises(ValueError, match=r"max_registers must be 0 or in \[24, 255\], got " + str(bad)):
            _rotary_cuda.LaunchConfig(128, 4, 1, max_registers=bad)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_rotary_launch_config_covers_shapes(dtype):
    """Every head count and head dim gets a geometry within the kernel's limits and an instantiated kernel."""
    names = set(_rotary_cuda.kernel_names())
    for heads, hs, rd in [(1, 2, 2), (3, 26, 10), (40, 128, 128), (40, 128, 32), (128, 256, 256), (2, 64, 48)]:
        for copy_rest in (False, True):
            _, groups = _rotary_cuda.groups_per_row(hs, rd, dtype, copy_rest)
            cfg = _rotary_cuda.launch_config(heads, groups)
            assert cfg.threads % 32 == 0 and cfg.threads <= _rotary_cuda.MAX_THREADS, (heads, hs, cfg)
            assert 1 <= cfg.tokens_per_block <= _rotary_cuda.MAX_TOKENS, (heads, hs, cfg)
            for tokens in (1, 7, 4096, 1 << 20):
                for narrow in (False, True):
                    runs = _rotary_cuda.launch_config(heads, groups, tokens=tokens, narrow=narrow).head_runs
                    # the kernel cuts the heads into runs of ceil(heads / runs): every run of the grid has heads
                    assert 1 <= runs <= heads and math.ceil(heads / math.ceil(heads / runs)) == runs, (heads, runs)
                    assert not narrow or runs == heads, (heads, runs)
            for table_f32 in ((True,) if dtype == torch.float32 else (True, False)):
                for interleaved in (False, True):
                    for io in _rotary_cuda.IO_MODES:
                        assert _rotary_cuda.kernel_name(dtype, table_f32, interleaved, io, cfg.items) in names


def test_rotary_whole_chunks():
    """Which rows take the CUDA kernel's 16-byte path alone (and which launches are narrow): the rotary half a
    whole number of 16-byte chunks, and a copied pass-through part too when out of place."""
    bf16, f32 = torch.bfloat16, torch.float32
    assert _rotary_cuda.whole_chunks(128, 128, bf16, False) and _rotary_cuda.whole_chunks(64, 64, bf16, True)
    assert not _rotary_cuda.whole_chunks(96, 24, bf16, True)  # GPT-NeoX-20B: the second half starts mid-chunk
    assert _rotary_cuda.whole_chunks(96, 24, f32, True) and not _rotary_cuda.whole_chunks(92, 24, f32, True)
    assert _rotary_cuda.whole_chunks(96, 32, bf16, True) and not _rotary_cuda.whole_chunks(88, 32, bf16, True)


def test_rotary_staged_rows():
    """Which rows take the staged-rows instance (IO 3): whole 16-byte chunks a row, groups that are not, and no
    more chunks than the block has threads; its geometry gives every chunk of a block's tokens a thread."""
    bf16, f32 = torch.bfloat16, torch.float32
    assert _rotary_cuda.staged_rows(96, 24, bf16, True) and _rotary_cuda.row_chunks(96, 24, bf16, True) == 12
    assert _rotary_cuda.staged_rows(96, 24, bf16, False) and _rotary_cuda.row_chunks(96, 24, bf16, False) == 3
    assert not _rotary_cuda.staged_rows(128, 128, bf16, False)  # whole groups: the 16-byte instance
    assert not _rotary_cuda.staged_rows(92, 24, bf16, True)  # a row's last chunk is partial
    assert _rotary_cuda.staged_rows(64, 20, f32, True) and not _rotary_cuda.staged_rows(64, 24, f32, True)
    assert not _rotary_cuda.staged_rows(4096, 24, bf16, True)  # 512 chunks: more than a block's threads
    # whole groups take it only where the table's rows are not aligned (the launcher's choice): they fit
    assert _rotary_cuda.rows_fit(128, 128, bf16, False) and not _rotary_cuda.rows_fit(4096, 24, bf16, True)
    assert _rotary_cuda.rows_fit(4096, 24, bf16, True, threads=256) is False
    flags = _rotary_cuda.VECTORIZED | _rotary_cuda.ROWS
    assert _rotary_cuda.io_mode(flags) == 3 and _rotary_cuda.io_mode(flags | _rotary_cuda.WHOLE_CHUNKS) == 2
    assert _rotary_cuda.io_mode(_rotary_cuda.ROWS) == 0
    for hs, rd in [(96, 24), (128, 40), (64, 60), (1024, 24)]:
        for copy_rest in (False, True):
            units, narrow = _rotary_cuda.work_units(hs, rd, bf16, copy_rest, True)
            assert not narrow
            for heads in (1, 13, 80):
                for tokens in (1, 131, 1 << 20):
                    cfg = _rotary_cuda.launch_config(heads, units, tokens=tokens)
                    assert cfg.tokens_per_block * units <= cfg.threads, (hs, rd, copy_rest, cfg)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("backward", (False, True), ids=("fwd", "bwd"))
def test_launch_config_covers_rows(dtype, backward):
    """Every row length gets a geometry the kernels were instantiated and budgeted for."""
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    cap, max_threads = (_norm_cuda.BWD_CAP, _norm_cuda.BWD_MAX_THREADS) if backward else \
        (_norm_cuda.fwd_cap(dtype), _norm_cuda.FWD_MAX_THREADS)
    names = set(_norm_cuda.kernel_names())
    for cols in [1, 7, 31, 123, 256, 1000, 1024, 4097, 8192, 12288, 16384, 32768, 50000, 65536]:
        cfg = _norm_cuda.launch_config(cols, dtype, backward)
        assert cfg.threads % 32 == 0 and 32 <= cfg.threads <= max_threads, (cols, cfg)
        assert cfg.rows_per_block == (4 if cfg.threads == 32 else 1), (cols, cfg)
        assert cfg.nv * vec <= cap, (cols, cfg)
        if cfg.nv:
            assert cfg.nv * cfg.threads * vec >= cols, (cols, cfg)  # the row fits in registers
        if backward:
            assert cfg.row_batch == 1, (cols, cfg)
        else:
            _norm_cuda.check_fwd_config(cfg)
        ctype = _norm_cuda._CTYPES[dtype][1]
        for io in (False, True):
            name = _norm_cuda._bwd_name(ctype, cfg.nv, True, io) if backward else \
                _norm_cuda._fwd_name(ctype, cfg.nv, io, cfg.row_batch)
            assert name in names, (cols, name)


def test_staged_backward_default_geometry():
    """The staged backward is the default only for 16-bit rows of 1024 elements and more, with a geometry its
    instances were built for that covers the row; other rows keep the register kernel (None)."""
    names = set(_norm_cuda.kernel_names())
    for dtype in (torch.float16, torch.bfloat16):
        ctype = _norm_cuda._CTYPES[dtype][1]
        for cols in (1024, 1032, 2048, 4096, 8192, 12288, 16384):
            for has_db in (False, True):
                cfg = _norm_cuda.staged_config(cols, dtype, has_db)
                if cfg is None:
                    assert has_db and cols > 8192, (cols, has_db)
                    continue
                assert cfg.staged and cfg.nv in _norm_cuda.STAGED_NV and cfg.rows_per_block == 1, cfg
                assert cfg.nv * cfg.threads * 8 >= cols and cfg.threads <= _norm_cuda.BWD_MAX_THREADS, (cols, cfg)
                assert _norm_cuda._bwd_staged_name(ctype, cfg.nv, has_db) in names
                spec = _norm_cuda.HAS_WEIGHT | _norm_cuda.HAS_DW | (0 if has_db else _norm_cuda.RMS)
                assert _norm_cuda._bwd_staged_name(ctype, cfg.nv, has_db, spec) in names
    assert _norm_cuda.staged_config(4096, torch.float32, False) is None
    assert _norm_cuda.staged_config(512, torch.bfloat16, False) is None


def test_forward_specializations_mirror_the_header():
    """megakern/_norm_cuda.py's flag bits and FWD_SPECS are csrc/norm/norm.h's, and fwd_spec picks as
    norm_fwd_spec does: a specialization only for 16-bit rows with 16-byte I/O and exactly its flags; every
    specialized instance is among the NVRTC names."""
    import re

    header = (CSRC / "norm" / "norm.h").read_text()
    bits = {name: 1 << int(shift) for name, shift in re.findall(r"NORM_(\w+) = 1 << (\d+)", header)}
    for name in ("RMS", "VECTORIZED", "HAS_WEIGHT", "HAS_BIAS", "W_F32", "HAS_RESIDUAL", "RES_F32", "GENERIC"):
        assert getattr(_norm_cuda, name) == bits[name], name
    body = re.search(r"NORM_FWD_SPECS\[\] = \{(.*?)\};", header, re.S).group(1)
    specs = tuple(sum(bits[b] for b in re.findall(r"NORM_(\w+)", item)) for item in body.split(","))
    assert specs == _norm_cuda.FWD_SPECS
    v, rms_w = _norm_cuda.VECTORIZED, _norm_cuda.RMS | _norm_cuda.HAS_WEIGHT
    assert _norm_cuda.fwd_spec(rms_w | v, torch.bfloat16) == rms_w
    assert _norm_cuda.fwd_spec(rms_w, torch.bfloat16) == 0  # element-wise I/O
    assert _norm_cuda.fwd_spec(rms_w | v, torch.float32) == 0
    assert _norm_cuda.fwd_spec(rms_w | v | _norm_cuda.GENERIC, torch.float16) == 0
    assert _norm_cuda.fwd_spec(rms_w | v | _norm_cuda.W_F32, torch.bfloat16) == 0  # fp32 weights: not specialized
    names = set(_norm_cuda.kernel_names())
    for spec in specs:
        for ctype in ("__half", "__nv_bfloat16"):
            assert _norm_cuda._fwd_name(ctype, 2, True, 1, spec) in names
            assert _norm_cuda._fwd_name(ctype, 1, True, 4, spec) in names


def test_backward_specializations_mirror_the_header():
    """BWD_SPECS are csrc/norm/norm.h's NORM_BWD_SPECS, and bwd_spec picks as norm_bwd_spec does: staged launches
    with exactly a specialization's flags (the other bits ignored), never RMSNorm with dbias sums, never GENERIC;
    every specialized instance is among the NVRTC names."""
    import re

    header = (CSRC / "norm" / "norm.h").read_text()
    bits = {name: 1 << int(shift) for name, shift in re.findall(r"NORM_(\w+) = 1 << (\d+)", header)}
    for name in ("HAS_DRES_OUT", "HAS_DRES", "HAS_DW", "STAGED"):
        assert getattr(_norm_cuda, name) == bits[name], name
    body = re.search(r"NORM_BWD_SPECS\[\] = \{(.*?)\};", header, re.S).group(1)
    specs = tuple(sum(bits[b] for b in re.findall(r"NORM_(\w+)", item)) for item in body.split(","))
    assert specs == _norm_cuda.BWD_SPECS
    mask = re.search(r"NORM_BWD_SPEC_MASK =(.*?);", header, re.S).group(1)
    assert sum(bits[b] for b in re.findall(r"NORM_(\w+)", mask)) == _norm_cuda.BWD_SPEC_MASK
    staged, v = _norm_cuda.STAGED, _norm_cuda.VECTORIZED
    rms_w = _norm_cuda.RMS | _norm_cuda.HAS_WEIGHT | _norm_cuda.HAS_DW
    assert _norm_cuda.bwd_spec(rms_w | v | staged, False) == rms_w
    assert _norm_cuda.bwd_spec(rms_w | v, False) == 0  # the register kernel
    assert _norm_cuda.bwd_spec(rms_w | v | staged, True) == 0  # RMSNorm has no bias
    assert _norm_cuda.bwd_spec(rms_w | v | staged | _norm_cuda.GENERIC, False) == 0
    assert _norm_cuda.bwd_spec(rms_w | v | staged | _norm_cuda.W_F32, False) == 0  # fp32 weights: not specialized
    ln = _norm_cuda.HAS_WEIGHT | _norm_cuda.HAS_DW | _norm_cuda.HAS_DRES_OUT
    assert _norm_cuda.bwd_spec(ln | v | staged, True) == ln
    names = set(_norm_cuda.kernel_names())
    for spec in specs:
        for ctype in ("__half", "__nv_bfloat16"):
            for nv in _norm_cuda.STAGED_NV:
                assert _norm_cuda._bwd_staged_name(ctype, nv, False, spec) in names
                assert (_norm_cuda._bwd_staged_name(ctype, nv, True, spec) in names) == (not spec & _norm_cuda.RMS)
