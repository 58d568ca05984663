"""The command line of the torchrun probes (parallel_sync_probe.py, parallel_refusal_probe.py): common overrides,
then runs, each ``FLAG NAME`` followed by its own overrides."""
from __future__ import annotations


def split_runs(argv: list[str], flag: str) -> list[tuple[str, list[str]]]:
    """[(run name, the common overrides + its own)] in order; [] without any ``flag``."""
    common, runs = [], []
    args = iter(argv)
    for arg in args:
        if arg == flag:
            runs.append((next(args), []))
        elif runs:
            runs[-1][1].append(arg)
        else:
            common.append(arg)
    return [(name, common + own) for name, own in runs]
