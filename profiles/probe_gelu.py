"""GELU (tanh) in three forms (0: tanh from exp and a division, 1: the sigmoid form x / (1 + exp2(.)), 2: the
hardware tanh.approx) and launch geometries (flat, 2-D tiles, tiles looping over rows), bf16 on one GPU, against the
same-run copy bandwidth, each checked against fp64. `python profiles/probe_gelu.py` (flat and tile forms),
`python profiles/probe_gelu.py loop` (the bias forms that loop over rows), `python profiles/probe_gelu.py order`
(the bias backward's tiles in both program orders). Results: docs/tuning.md, bias + GELU."""
import sys

import torch
import triton
import triton.language as tl

from benchmarks.common import bench, measure_copy_gbps
from megakern._activation_triton import _gelu_grad



@triton.jit
def _tanh0(z):
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -t, t)


@triton.jit
def _tanh_hw(z):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [z], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gelu(x, FORM: tl.constexpr):
    if FORM == 0:
        t = _tanh0(0.7978845608028654 * (x + 0.044715 * x * x * x))
        y = 0.5 * x * (1.0 + t)
    elif FORM == 1:
        y = x / (1.0 + tl.exp2(x * (-2.302208198 + -0.102943240 * x * x)))
    else:
        u = x * (0.7978845608028654 + 0.035677408136300125 * x * x)
        hx = 0.5 * x
        y = hx + hx * _tanh_hw(u)
    return y


@triton.jit
def _dgelu(x, FORM: tl.constexpr):
    if FORM == 0:
        t = _tanh0(0.7978845608028654 * (x + 0.044715 * x * x * x))
        g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    elif FORM == 1:
        x2 = x * x
        s = 1.0 / (1.0 + tl.exp2(x * (-2.302208198 + -0.102943240 * x2)))
        # d/dx x s(2u) = s + 2 x s (1 - s) u'
        g = s + (x - x * s) * s * (1.5957691216057308 + 0.2140644488178018 * x2)
    elif FORM == 3:  # megakern's own (the same bits as its kernels)
        g = _gelu_grad(x)
    else:
        x2 = x * x
        t = _tanh_hw(x * (0.7978845608028654 + 0.035677408136300125 * x2))
        hx = 0.5 * x
        g = 0.5 + 0.5 * t + (hx - hx * t * t) * (0.7978845608028654 + 0.10703222440890 * x2)
    return g


@triton.jit
def fwd_flat(H, Y, numel, FORM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, _gelu(x, FORM).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def fwd_bias_mod(H, Bp, Y, numel, N, FORM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(Bp + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, _gelu(x, FORM).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def fwd_bias_tile(H, Bp, Y, M, N, FORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(Bp + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, _gelu(x, FORM).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def bwd_flat(DY, H, DH, numel, FORM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DH + offs, (dy * _dgelu(x, FORM)).to(DH.dtype.element_ty), mask=mask)


@triton.jit
def bwd_tile(DY, H, Bp, DH, PART, M, N, HAS_BIAS: tl.constexpr, FORM: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, COLS_FAST: tl.constexpr = False):
    """COLS_FAST: the programs ordered along the columns first (those running at once cover whole rows), else down
    the rows first (as megakern's launcher orders them)"""
    if COLS_FAST:
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    else:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(Bp + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    dh = (dy * _dgelu(x, FORM)).to(DH.dtype.element_ty)
    tl.store(DH + offs, dh, mask=mask)
    if HAS_BIAS:
        tl.store(PART + pid_m.to(tl.int64) * N + cols, tl.sum(dh.to(tl.float32), axis=0), mask=col_ok)


@triton.jit
def bwd_loop(DY, H, Bp, DH, PART, M, N, FORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    bias = tl.load(Bp + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in tl.range(0, ROWS, BLOCK_M):
        rows = pid_m * ROWS + r + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32) + bias
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        dh = (dy * _dgelu(x, FORM)).to(DH.dtype.element_ty)
        tl.store(DH + offs, dh, mask=mask)
        acc += dh.to(tl.float32)
    tl.store(PART + pid_m.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def fwd_loop(H, Bp, Y, M, N, FORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    bias = tl.load(Bp + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    for r in tl.range(0, ROWS, BLOCK_M):
        rows = pid_m * ROWS + r + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32) + bias
        tl.store(Y + offs, _gelu(x, FORM).to(Y.dtype.element_ty), mask=mask)


def ref(h, b):
    x = h.double() + (0 if b is None else b.double())
    y = torch.nn.functional.gelu(x, approximate="tanh")
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(torch.nn.functional.gelu(xg, approximate="tanh").sum(), xg)
    return y, g


def _inputs(m, n, dev):
    """h, bias and dy in bf16, the same draw for every probe"""
    torch.manual_seed(0)
    h = (2 * torch.randn(m, n, device=dev)).to(torch.bfloat16)
    return h, (0.5 * torch.randn(n, device=dev)).to(torch.bfloat16), torch.randn_like(h)


def _time_all(form, cfgs, out, truth, nbytes, copy, dev):
    """each (name, launch) of cfgs run once, checked against the fp64 truth, then timed"""
    for name, f in cfgs:
        f()
        err = (out.double() - truth).abs().max().item()
        t = bench(f, device=dev)["median"]
        gb = nbytes / t / 1e6
        print(f"form {form} {name:24} {t * 1e3:7.1f} us {gb:6.0f} GB/s ({gb / copy:.2f}) err {err:.3g}", flush=True)


def main():
    dev = torch.device("cuda")
    copy = measure_copy_gbps(dev)
    print(f"copy {copy:.0f} GB/s", flush=True)
    for m, n in ((16384, 1536), (16384, 4096)):
        h, b, dy = _inputs(m, n, dev)
        numel = h.numel()
        act = numel * 2
        for bias in (False, True):
            y64, g64 = ref(h, b if bias else None)
            dh64 = dy.double() * g64
            yt = torch.nn.functional.gelu(h.float() + (b.float() if bias else 0), approximate="tanh").to(h.dtype)
            base_err = (yt.double() - y64).abs().max().item()
            dht = (dy.float() * g64.float()).to(h.dtype)
            base_derr = (dht.double() - dh64).abs().max().item()
            print(f"== {m}x{n} bias={bias}: bf16 rounding alone: y {base_err:.3g} dh {base_derr:.3g}", flush=True)
            for form in (0, 1, 2):
                y = torch.empty_like(h)
                cfgs = []
                for block, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)):
                    if bias:
                        def f(block=block, warps=warps):
                            fwd_bias_mod[(triton.cdiv(numel, block),)](h, b, y, numel, n, FORM=form, BLOCK=block,
                                                                       num_warps=warps)
                    else:
                        def f(block=block, warps=warps):
                            fwd_flat[(triton.cdiv(numel, block),)](h, y, numel, FORM=form, BLOCK=block,
                                                                   num_warps=warps)
                    cfgs.append((f"fwd {'mod' if bias else 'flat'} {block}/{warps}w", f))
                if bias:
                    for bm, bn, warps in ((16, 256, 4), (32, 128, 4), (32, 256, 8), (64, 128, 8)):
                        def f(bm=bm, bn=bn, warps=warps):
                            fwd_bias_tile[(triton.cdiv(m, bm), triton.cdiv(n, bn))](h, b, y, m, n, FORM=form,
                                                                                   BLOCK_M=bm, BLOCK_N=bn,
                                                                                   num_warps=warps)
                        cfgs.append((f"fwd tile {bm}x{bn}/{warps}w", f))
                _time_all(form, cfgs, y, y64, 2 * act, copy, dev)
                dh = torch.empty_like(h)
                bcfgs = []
                if not bias:
                    for block, warps in ((2048, 4), (4096, 8), (8192, 8)):
                        def f(block=block, warps=warps):
                            bwd_flat[(triton.cdiv(numel, block),)](dy, h, dh, numel, FORM=form, BLOCK=block,
                                                                   num_warps=warps)
                        bcfgs.append((f"bwd flat {block}/{warps}w", f))
                for bm, bn, warps in ((32, 128, 4), (16, 256, 4), (32, 256, 8)):
                    pm = torch.empty((triton.cdiv(m, bm), n), dtype=torch.float32, device=dev)
                    def f(bm=bm, bn=bn, warps=warps, pm=pm):
                        bwd_tile[(triton.cdiv(m, bm), triton.cdiv(n, bn))](dy, h, b, dh, pm, m, n, HAS_BIAS=bias,
                                                                           FORM=form, BLOCK_M=bm, BLOCK_N=bn,
                                                                           num_warps=warps)
                    bcfgs.append((f"bwd tile {bm}x{bn}/{warps}w", f))
                _time_all(form, bcfgs, dh, dh64, 3 * act, copy, dev)


LOOPS = ((32, 128, 128, 4), (32, 128, 256, 4), (16, 256, 128, 4), (16, 256, 256, 4), (32, 256, 256, 8),
         (64, 128, 256, 8), (8, 512, 128, 4), (16, 128, 64, 4), (32, 128, 512, 4))


def main2():
    dev = torch.device("cuda")
    copy = measure_copy_gbps(dev)
    print(f"copy {copy:.0f} GB/s", flush=True)
    for m, n in ((16384, 1536), (16384, 4096), (8192, 8192), (16384, 1024), (4096, 16384)):
        h, b, dy = _inputs(m, n, dev)
        act = h.numel() * 2
        y64, g64 = ref(h, b)
        dh64 = dy.double() * g64
        db64 = dh64.sum(0)
        y, dh = torch.empty_like(h), torch.empty_like(h)
        print(f"== {m}x{n} bias", flush=True)
        for form in (1,):
            for bm, bn, rows, warps in LOOPS:
                part = torch.empty((triton.cdiv(m, rows), n), dtype=torch.float32, device=dev)
                grid = (triton.cdiv(m, rows), triton.cdiv(n, bn))

                def fb():
                    bwd_loop[grid](dy, h, b, dh, part, m, n, FORM=form, ROWS=rows, BLOCK_M=bm, BLOCK_N=bn,
                                   num_warps=warps)

                def ff():
                    fwd_loop[grid](h, b, y, m, n, FORM=form, ROWS=rows, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)

                fb(); ff()
                err = (dh.double() - dh64).abs().max().item()
                derr = ((part.double().sum(0) - db64).abs().max() / db64.abs().max()).item()
                yerr = (y.double() - y64).abs().max().item()
                tb, tf = bench(fb, device=dev)["median"], bench(ff, device=dev)["median"]
                gb, gf = 3 * act / tb / 1e6, 2 * act / tf / 1e6
                print(f"form {form} loop {bm}x{bn} rows {rows} {warps}w  bwd {tb * 1e3:7.1f} us ({gb / copy:.2f}) "
                      f"err {err:.3g} db rel {derr:.2g} | fwd {tf * 1e3:7.1f} us ({gf / copy:.2f}) err {yerr:.3g}",
                      flush=True)


ORDER_TILES = ((32, 128, 4), (16, 256, 4), (8, 512, 4), (4, 1024, 4), (64, 64, 4), (32, 256, 8))


def main_order():
    """The backward with a bias, its tiles in both program orders, beside the launcher's whole backward (tiles and
    the sums' pass: megakern._activation_triton.bwd)."""
    from megakern import _activation_triton as kern

    dev = torch.device("cuda")
    copy = measure_copy_gbps(dev)
    print(f"copy {copy:.0f} GB/s", flush=True)
    for m, n in ((16384, 1536), (16384, 4096), (8192, 8192), (65536, 1024)):
        h, b, dy = _inputs(m, n, dev)
        nbytes = 3 * h.numel() * 2
        want_dh, want_db = kern.bwd(dy, h, b)
        t = bench(lambda: kern.bwd(dy, h, b), device=dev)["median"]
        print(f"== {m}x{n}: megakern bwd (tiles + sums) {t * 1e3:7.1f} us ({nbytes / t / 1e6 / copy:.2f})", flush=True)
        dh = torch.empty_like(h)
        for bm, bn, warps in ORDER_TILES:
            part = torch.empty((triton.cdiv(m, bm), n), dtype=torch.float32, device=dev)
            for cols_fast in (False, True):
                tiles = (triton.cdiv(m, bm), triton.cdiv(n, bn))
                grid = tiles[::-1] if cols_fast else tiles

                def f():
                    bwd_tile[grid](dy, h, b, dh, part, m, n, HAS_BIAS=True, FORM=3, BLOCK_M=bm, BLOCK_N=bn,
                                   COLS_FAST=cols_fast, num_warps=warps)

                f()
                ok = torch.equal(dh, want_dh) and torch.allclose(part.sum(0), want_db.float(), rtol=1e-2, atol=1e-1)
                t = bench(f, device=dev)["median"]
                print(f"tile {bm}x{bn} {warps}w {'columns first' if cols_fast else 'rows first   '} {t * 1e3:7.1f} us "
                      f"({nbytes / t / 1e6 / copy:.2f}){'' if ok else ' WRONG'}", flush=True)


if __name__ == "__main__":
    {"loop": main2, "order": main_order}.get(sys.argv[1] if sys.argv[1:] else "", main)()
