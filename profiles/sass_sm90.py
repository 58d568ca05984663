"""Resources of the norm and cross-entropy Triton kernels compiled for sm_90, without a GPU.

Compiles a kernel with the specializations a launch on aligned tensors gets (pointers, strides and the row length
divisible by 16; without them the loads are not vectorized and the figures mean nothing), for sm_90, and reads the
cubin with the cuobjdump that ships with Triton: registers a thread, bytes spilled to local memory, SASS
instructions and barriers (BAR), the local loads and stores (LDL, STL) and shared memory. Figures are those of this
machine's Triton and its ptxas: install the Triton the GPU machines run (3.6) to read theirs.

    python profiles/sass_sm90.py norm --ops rms,ln --hidden 9216,12288 --warps 4,8,16 [--tail] [--rows 1]
                                      [--three] [--backward [--prefetch]] [--residual] [--maxnreg 80]
                                      [--wide 2048 [--unrolled] [--stages 2] [--order]]
    python profiles/sass_sm90.py ce --blocks 8192,16384,32768 --warps 32 [--smoothing] [--softcap]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "0")  # real kernels: an interpreted one has nothing to compile

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megakern import _cross_entropy_triton, _norm_triton  # noqa: E402


def compile_sm90(fn, constexprs: dict, types: dict, warps: int, maxnreg: int | None = None):
    """``fn`` compiled for sm_90: arguments in ``constexprs`` as constants (the constexprs left out at their defaults,
    as a launch leaves them), the others typed by ``types`` (i32 when absent); pointers, strides and the names in
    ``types`` marked "/16" (stripped) divisible by 16."""
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs
    signature, divisible = {}, []
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        kind = types.get(name, "i32")
        signature[name] = kind.removesuffix("/16")
        if kind.startswith("*") or kind.endswith("/16") or name.startswith("stride"):
            divisible.append((i,))
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                       attrs={key: [["tt.divisibility", 16]] for key in divisible})
    options = dict(num_warps=warps) if maxnreg is None else dict(num_warps=warps, maxnreg=maxnreg)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _cubin_text(compiled) -> tuple[str, list[str]]:
    """(resource usage, SASS instructions without their encodings) of the compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    return usage, [line.split("*/", 1)[1].strip() for line in sass.splitlines()
                   if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def resources(compiled) -> str:
    """One line of the compiled kernel's resources, read from its cubin."""
    usage, code = _cubin_text(compiled)

    def count(opcode: str) -> int:
        return sum(1 for line in code if re.match(r"(@!?U?P\w+ )?" + opcode + r"\b", line))

    regs, spill = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
    return (f"regs {regs:>3} spilled {spill:>4} B  instructions {len(code):5d}  BAR {count('BAR'):3d}  "
            f"LDL {count('LDL'):3d}  STL {count('STL'):3d}  shared {compiled.metadata.shared} B")


def order(compiled, width: int = 100) -> str:
    """The kernel's global loads (L), stores (S), float arithmetic (F) and barriers (B) in SASS order, the first
    ``width``: whether ptxas issued a pass's loads before its math."""
    def kind(line: str) -> str:
        op = re.sub(r"^@!?U?P\w+ ", "", line).split(" ", 1)[0]
        if op.startswith(("LDG", "LDGSTS")):
            return "L"
        if op.startswith("STG"):
            return "S"
        if op.startswith(("FFMA", "FMUL", "FADD")):
            return "F"
        return "B" if op.startswith("BAR") else ""
    return "".join(kind(line) for line in _cubin_text(compiled)[1])[:width]


NORM_POINTERS = {"X", "RES", "W", "B", "Y", "RES_OUT", "DY", "DRES_OUT", "DX"}
NORM_FP32 = {"MEAN", "RSTD", "DRES", "DW_PARTIAL", "DB_PARTIAL", "ROW_SUMS"}


def norm_row(is_rms: bool, n: int, warps: int, tail: bool, rows: int, backward: bool, prefetch: bool,
             residual: bool, three: bool = False, maxnreg: int | None = None) -> str:
    """The register kernel (forward or backward) of one geometry, as its launcher would compile it; ``three``: the
    forward's three tiles (three_split), where the width has them."""
    thirds = _norm_triton.three_split(n) if three and not backward else None
    split = _norm_triton.tail_split(n) if tail else None
    head, tail_cols = thirds[:2] if thirds else split or (triton.next_power_of_2(n), 0)
    third_cols = thirds[2] if thirds else 0
    types = {name: "*bf16" for name in NORM_POINTERS} | {name: "*fp32" for name in NORM_FP32} | {
        "eps": "fp32", "N": "i32/16"}
    flags = dict(IS_RMS=is_rms, HAS_W=True, BLOCK_M=rows, BLOCK_N=head, BLOCK_T=tail_cols, ALIGN=1)
    if backward:
        fn = _norm_triton._norm_bwd_kernel
        flags |= dict(HAS_DW=True, HAS_DB=not is_rms, HAS_DRES_OUT=residual, HAS_DRES=False, PREFETCH=prefetch,
                      EVEN_N=n == head)
    else:
        fn = _norm_triton._norm_fwd_kernel
        flags |= dict(HAS_RES=residual, HAS_B=not is_rms, BLOCK_U=third_cols,
                      EVEN_N=n == head + tail_cols + third_cols if thirds else n == head)
    tiles = thirds or ((head, tail_cols) if tail_cols else head)
    label = (f"{'rms' if is_rms else 'ln '} {'bwd' if backward else 'fwd'} {n:5d} warps {warps:2d} rows {rows} "
             f"tiles {tiles}{' prefetch' if backward and prefetch else ''}")
    label += f" maxnreg {maxnreg}" if maxnreg else ""
    return f"{label:58s} {resources(compile_sm90(fn, flags, types, warps, maxnreg))}"


def norm_wide_row(is_rms: bool, n: int, warps: int, chunk: int, unrolled: bool, rows: int, backward: bool,
                  residual: bool, stages: int = 1, show_order: bool = False) -> str:
    """The two-pass kernel (forward or backward) for rows of ``n`` in ``chunk``-column pieces, looped (``stages``
    through shared memory) or unrolled over the row's chunk count, as its launcher would compile it."""
    chunks = -(-n // chunk) if unrolled else 0
    types = {name: "*bf16" for name in NORM_POINTERS} | {name: "*fp32" for name in NORM_FP32} | {
        "eps": "fp32", "N": "i32/16"}
    flags = dict(IS_RMS=is_rms, HAS_W=True, CHUNK=chunk, STAGES=stages, CHUNKS=chunks,
                 EVEN_N=unrolled and n == chunks * chunk)
    if backward:
        fn = _norm_triton._norm_bwd_wide_kernel
        flags |= dict(HAS_DW=True, HAS_DB=not is_rms, HAS_DRES_OUT=residual, HAS_DRES=False, BLOCK_M=rows)
    else:
        fn = _norm_triton._norm_fwd_wide_kernel
        flags |= dict(HAS_RES=residual, HAS_B=not is_rms, SUMS=_norm_triton.wide_fwd_sums(is_rms, unrolled, chunk),
                      WIDTH=n if unrolled else 0)
    if "ALIGN" in fn.arg_names:
        flags["ALIGN"] = 1
    compiled = compile_sm90(fn, flags, types, warps)
    label = (f"{'rms' if is_rms else 'ln '} {'bwd' if backward else 'fwd'} {n:5d} warps {warps:2d} wide chunk "
             f"{chunk} {'unrolled' if unrolled else f'looped stages {stages}'}{f' rows {rows}' if backward else ''}")
    line = f"{label:58s} {resources(compiled)}"
    return line + f"\n    order {order(compiled)}" if show_order else line


def ce_row(block: int, warps: int, smoothing: bool, softcap: bool) -> str:
    """The cross-entropy kernel with the gradient, as its launcher would compile it."""
    types = {"LOGITS": "*bf16", "GRAD": "*bf16", "TARGETS": "*i64", "LOSS": "*fp32", "LSE": "*fp32",
             "SCALE": "*fp32", "label_smoothing": "fp32", "softcap": "fp32", "V": "i32/16"}
    flags = dict(HAS_SMOOTHING=smoothing, HAS_SOFTCAP=softcap, HAS_GRAD=True, BLOCK_V=block)
    compiled = compile_sm90(_cross_entropy_triton._cross_entropy_kernel, flags, types, warps)
    label = f"ce block {block:5d} warps {warps:2d}{' smoothing' if smoothing else ''}{' softcap' if softcap else ''}"
    return f"{label:58s} {resources(compiled)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kernel", required=True)
    norm = sub.add_parser("norm")
    norm.add_argument("--ops", default="rms,ln")
    norm.add_argument("--hidden", default="9216")
    norm.add_argument("--warps", default="4,8,16")
    norm.add_argument("--rows", type=int, default=1)
    norm.add_argument("--tail", action="store_true", help="the row as two power-of-two tiles (tail_split)")
    norm.add_argument("--three", action="store_true", help="the forward's row as three tiles (three_split)")
    norm.add_argument("--backward", action="store_true")
    norm.add_argument("--prefetch", action="store_true", help="--backward: the next step's rows loaded ahead")
    norm.add_argument("--residual", action="store_true")
    norm.add_argument("--maxnreg", type=int, default=None, help="a bound on a thread's registers (ptxas .maxnreg)")
    norm.add_argument("--wide", type=int, default=None, metavar="CHUNK",
                      help="the two-pass kernel, CHUNK columns at a time (--rows: the backward's rows a step)")
    norm.add_argument("--unrolled", action="store_true", help="--wide: unrolled over the row's chunk count")
    norm.add_argument("--stages", type=int, default=1, help="--wide, looped: chunks in flight through shared memory")
    norm.add_argument("--order", action="store_true",
                      help="--wide: the loads (L), stores (S), float math (F) and barriers (B) in SASS order")
    ce = sub.add_parser("ce")
    ce.add_argument("--blocks", default="16384")
    ce.add_argument("--warps", default="32")
    ce.add_argument("--smoothing", action="store_true")
    ce.add_argument("--softcap", action="store_true")
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90")
    if args.kernel == "norm":
        for op in args.ops.split(","):
            for n in map(int, args.hidden.split(",")):
                for warps in map(int, args.warps.split(",")):
                    if args.wide:
                        print(norm_wide_row(op == "rms", n, warps, args.wide, args.unrolled, args.rows,
                                            args.backward, args.residual, args.stages, args.order), flush=True)
                        continue
                    print(norm_row(op == "rms", n, warps, args.tail, args.rows, args.backward, args.prefetch,
                                   args.residual, args.three, args.maxnreg), flush=True)
    else:
        for block in map(int, args.blocks.split(",")):
            for warps in map(int, args.warps.split(",")):
                print(ce_row(block, warps, args.smoothing, args.softcap), flush=True)


if __name__ == "__main__":
    main()
