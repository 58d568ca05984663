"""Optional dependencies (contract 10, docs/contracts.md): ``optional_module`` imports one and checks its version,
or says why it cannot serve: a package that cannot be imported, a folder of its name that shadows it, or a version
below the floor is named with the version found, the version needed and the pip command. Used by the backend rules
(triton, liger_kernel), the NVRTC path (cupy) and the training log (wandb); imports nothing of megakern."""
from __future__ import annotations

import importlib
import importlib.metadata


def version_tuple(version: str, parts: int = 2) -> tuple[int, ...]:
    """The first ``parts`` numbers of a version string ('2.11.0+cu130' -> (2, 11)); missing ones are 0."""
    numbers = []
    for piece in version.split("+")[0].split(".")[:parts]:
        digits = ""
        for ch in piece:  # '0rc1' -> 0: the digits before any pre-release tag
            if not ch.isdigit():
                break
            digits += ch
        numbers.append(int(digits or 0))
    return tuple(numbers + [0] * (parts - len(numbers)))


def optional_module(module: str, minimum: tuple[int, ...], purpose: str, *, install: str | None = None):
    """(the imported optional dependency ``module``, '') or (None, why it cannot serve ``purpose``).

    Why not: it cannot be imported (the import's error); ``import module`` found a folder without the package (a
    namespace package, e.g. a run directory called ``wandb``, shadowing any installed one); its version (its
    ``__version__``, else the installed distribution's) cannot be read; or it is below ``minimum``. The reason names
    the version found, the version needed and ``install`` (default: pip install -U 'module>=minimum').
    """
    wanted = f"{module}>={'.'.join(map(str, minimum))}"
    install = install or f"pip install -U '{wanted}'"
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError (OSError, RuntimeError)
        return None, f"{wanted} is needed for {purpose} but cannot be imported ({type(exc).__name__}: {exc}); {install}"
    if getattr(mod, "__file__", None) is None:
        where = ", ".join(map(str, getattr(mod, "__path__", []))) or "?"
        return None, (f"{wanted} is needed for {purpose}, but 'import {module}' found a folder without the package "
                      f"({where}), which shadows any installed one: rename that folder or run from another directory")
    version = getattr(mod, "__version__", None)
    if not isinstance(version, str):
        try:
            version = importlib.metadata.version(module)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            return None, (f"{wanted} is needed for {purpose}; the version of {module} ({mod.__file__}) cannot be read; "
                          f"{install}")
    if version_tuple(version, len(minimum)) < tuple(minimum):
        return None, f"{wanted} is needed for {purpose}, found {module} {version} ({mod.__file__}); {install}"
    return mod, ""
