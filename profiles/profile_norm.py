"""Profile the norm kernels: each backend's forward and backward once, inside NVTX ranges.

    python profiles/profile_norm.py                       # run under any profiler (Nsight Systems / Compute)
    python profiles/profile_norm.py --ncu OUT.csv         # re-run itself under ncu and summarize per kernel
    python profiles/profile_norm.py --ncu OUT.csv --sections --hidden 1024 --backends cuda

With --ncu: duration, DRAM bytes read + written, and achieved bandwidth per kernel, from the hardware counters
(clocks left alone), next to the bytes a fused kernel must move. DRAM bytes well over that mean re-reads.
--sections: Nsight Compute's SpeedOfLight, Occupancy, LaunchStats and WarpStateStats sections instead, with the
instructions executed and the stall cycles per issued instruction by reason (where a kernel's warps wait), every
metric listed per kernel. --hidden: the row length (2**27 elements a tensor; default
8192, 16384 rows).
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import shutil
import subprocess
import sys

import torch

ELEMENTS = 2**27  # per activation tensor
METRICS = ("gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,"
           "sm__warps_active.avg.pct_of_peak_sustained_active,launch__block_size,launch__grid_size")


SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats")
# With the sections: instructions executed, and the cycles a warp spends stalled for each reason per instruction it
# issues (the WarpStateStats section's breakdown, which its details page leaves out)
STALL_REASONS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
                 "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected", "selected",
                 "short_scoreboard", "sleeping", "tex_throttle", "wait")
STALL_METRICS = ",".join(["smsp__inst_executed.sum"] + [
    f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio" for reason in STALL_REASONS])


def run_ops(backends: list[str], hidden: int) -> None:
    import megakern

    x = torch.randn(ELEMENTS // hidden, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    for backend in backends:
        for op, args in (("rms_norm", (x, w)), ("layer_norm", (x, w, b))):
            with torch.cuda.nvtx.range(f"{op}[{backend}]"):
                y = getattr(megakern, op)(*args, backend=backend)
                torch.autograd.grad(y, args, dy)
    torch.cuda.synchronize()


def find_ncu() -> str | None:
    return shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)


def profile(out_csv: str, backends: list[str], hidden: int, sections: bool) -> None:
    ncu = find_ncu()
    if ncu is None:
        sys.exit("ncu (Nsight Compute) not found")
    what = ([arg for name in SECTIONS for arg in ("--section", name)] + ["--metrics", STALL_METRICS] if sections
            else ["--metrics", METRICS])
    cmd = [ncu, "--clock-control", "none", *what, "--kernel-name", "regex:norm", "--csv",
           sys.executable, __file__, "--backends", ",".join(backends), "--hidden", str(hidden)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = proc.stdout[proc.stdout.find('"ID"'):]
    if proc.returncode or not text:
        sys.exit(f"ncu failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out_csv, "w") as f:
        f.write(text)
    if sections:
        list_sections(text)
    else:
        summarize(text, hidden)


def list_sections(text: str) -> None:
    """Every metric of ncu's section CSV, per kernel."""
    current = None
    for row in csv.DictReader(io.StringIO(text)):
        key = (row["ID"], row["Kernel Name"][:90])
        if key != current:
            current = key
            print(f"\n{key[0]} {key[1]}")
        print(f"  {row.get('Section Name', ''):28} {row['Metric Name']:52} {row['Metric Value']:>14} "
              f"{row['Metric Unit']}")


def summarize(text: str, hidden: int) -> None:
    """Per-kernel table from ncu's CSV."""
    kernels: dict[tuple[str, str], dict[str, float]] = {}
    for row in csv.DictReader(io.StringIO(text)):
        key = (row["ID"], row["Kernel Name"][:60])
        value = float(row["Metric Value"].replace(",", ""))
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "ns": 1e-9, "nsecond": 1e-9, "us": 1e-6,
                 "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3}.get(row["Metric Unit"], 1)
        kernels.setdefault(key, {})[row["Metric Name"]] = value * scale
    act = ELEMENTS * 2
    print(f"per kernel, {ELEMENTS // hidden}x{hidden} bf16 (one activation tensor = {act / 1e6:.0f} MB; fused fwd "
          f"moves 2 of them, bwd 3):")
    print(f"{'kernel':62} {'us':>8} {'DRAM MB':>9} {'tensors':>8} {'GB/s':>7} {'regs':>5} {'occ%':>5} "
          f"{'block':>6} {'grid':>7}")
    for (_, name), m in kernels.items():
        t = m["gpu__time_duration.sum"]
        moved = m["dram__bytes_read.sum"] + m["dram__bytes_write.sum"]
        print(f"{name:62} {t * 1e6:8.1f} {moved / 1e6:9.1f} {moved / act:8.2f} {moved / t / 1e9:7.0f} "
              f"{m.get('launch__registers_per_thread', 0):5.0f} "
              f"{m.get('sm__warps_active.avg.pct_of_peak_sustained_active', 0):5.1f} "
              f"{m.get('launch__block_size', 0):6.0f} {m.get('launch__grid_size', 0):7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ncu", metavar="CSV", help="profile under Nsight Compute, raw metrics to CSV")
    parser.add_argument("--backends", default="triton,cuda")
    parser.add_argument("--summarize", metavar="CSV", help="only print the table of an earlier --ncu CSV")
    parser.add_argument("--hidden", type=int, default=8192, help="row length (2**27 elements a tensor)")
    parser.add_argument("--sections", action="store_true", help="with --ncu: Nsight Compute's sections, every metric")
    args = parser.parse_args()
    backends = args.backends.split(",")
    if not 1 <= args.hidden <= ELEMENTS:
        sys.exit(f"--hidden must be in 1..{ELEMENTS}, got {args.hidden}")
    if args.summarize:
        with open(args.summarize) as f:
            summarize(f.read(), args.hidden)
    elif args.ncu:
        profile(args.ncu, backends, args.hidden, args.sections)
    else:
        run_ops(backends, args.hidden)


if __name__ == "__main__":
    main()
