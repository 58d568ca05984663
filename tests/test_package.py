"""Packaging: an install from a source tree or from the sdist, with or without a buildable CUDA extension.

- parallel/ and models/ install as megakern.parallel and megakern.models (no top-level `models` or `parallel`), and
  the kernel sources travel inside the package (megakern/_csrc) for the NVRTC path;
- where torch has CUDA and nvcc exists but the extension does not build, the install is pure Python with one line
  saying why; where the extension is asked for by name, the failure fails the command;
- the sdist carries every file of csrc/ (headers included), configs/, LICENSE and README, and a wheel built from it
  carries the kernels;
- pyproject.toml is the one place of the metadata: one version (megakern.__version__), the dependencies megakern
  imports, the extras, the console script; no module of the package or of benchmarks/ edits sys.path.

Every build runs on a copy of the tree in tmp_path, so no build/ or egg-info lands in the checkout. A fake CUDA
toolkit stands in for a broken one: a sitecustomize makes torch.version.cuda read "13.0" and torch's cpp_extension
find the toolkit in tmp_path, whose nvcc answers --version as CUDA 13.0 does and fails every compile as a CUDA 11
nvcc fails on sm_90a.
"""
import ast
import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Directories of the package, as the tree holds them -> the installed package's name.
PACKAGE_DIRS = {"megakern": "megakern", "parallel": "megakern.parallel", "models": "megakern.models"}
NVCC_ERROR = "nvcc fatal   : Unsupported gpu architecture 'compute_90a'"

FAKE_NVCC = f"""#!/bin/sh
for arg in "$@"; do
  if [ "$arg" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
done
echo "{NVCC_ERROR}" >&2
exit 1
"""

FAKE_CUDA_TORCH = '''"""torch.version.cuda reads "13.0"; cpp_extension finds the toolkit at $MEGAKERN_TEST_CUDA_HOME."""
import importlib.machinery
import os
import sys


class FakeCudaTorch:
    def find_spec(self, name, path=None, target=None):
        if name not in ("torch.version", "torch.utils.cpp_extension"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if name == "torch.version":
                module.cuda = "13.0"
            else:
                module.CUDA_HOME = os.environ["MEGAKERN_TEST_CUDA_HOME"]

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, FakeCudaTorch())
'''


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _tree(tmp_path: Path) -> Path:
    """A copy of the working tree's files (tracked, and untracked ones git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    src = tmp_path / "src"
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is left out
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, src / name)
    return src


def _env(tmp_path: Path, **extra) -> dict:
    """The environment of a build: none of setup.py's switches inherited, temporary files under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAKERN_") and k != "PYTHONPATH"}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**env, "TMPDIR": str(tmp_path / "tmp"), "PIP_NO_INPUT": "1", **extra}


def _fake_cuda(tmp_path: Path) -> dict:
    """Environment entries that make a build see a CUDA torch and a CUDA toolkit whose nvcc fails every compile."""
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "cuda" / "include").mkdir()
    (bin_dir / "nvcc").write_text(FAKE_NVCC)
    (bin_dir / "nvcc").chmod(0o755)
    site = tmp_path / "fake-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_CUDA_TORCH)
    return {"PYTHONPATH": str(site), "MEGAKERN_TEST_CUDA_HOME": str(tmp_path / "cuda")}


def _pip_install(source, target: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps",
                           "--no-index", "--no-compile", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def _said(proc: subprocess.CompletedProcess) -> list[str]:
    """setup.py's own lines in a build's output."""
    return [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip().startswith("megakern:")]


def _check_imports(target: Path, cwd: Path) -> str:
    check = ("import megakern, megakern.data.gpt_dataset, megakern.parallel, megakern.models, megakern._cuda as c; "
             "print(megakern.__file__); print(megakern.parallel.__file__); print(c.csrc_root())")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    files = out.stdout.split()
    assert all(f.startswith(str(target)) for f in files), out.stdout
    assert files[-1] == str(target / "megakern" / "_csrc")
    return out.stdout


def _kernel_sources() -> list[str]:
    """csrc/'s files that the NVRTC path reads (setup.py's KERNEL_SUFFIXES), relative to csrc/."""
    return sorted(p.relative_to(ROOT / "csrc").as_posix() for p in (ROOT / "csrc").rglob("*")
                  if p.suffix in (".cu", ".cuh", ".h"))


def test_pip_install_gives_working_imports(tmp_path):
    src, target = _tree(tmp_path), tmp_path / "site"
    proc = _pip_install(src, target, _env(tmp_path, MEGAKERN_PURE_PYTHON="1"), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _said(proc) == ["megakern: pure-Python install (MEGAKERN_PURE_PYTHON=1); the CUDA kernels compile at run "
                           "time through cupy's NVRTC where it is installed"]
    assert not (target / "models").exists() and not (target / "parallel").exists()
    for name in _kernel_sources():
        assert (target / "megakern" / "_csrc" / name).is_file(), name
    assert (target / "bin" / "megakern-train").is_file() and (target / "bin" / "megakern-export").is_file()
    _check_imports(target, tmp_path)


def test_pip_install_falls_back_to_pure_python_when_the_extension_does_not_build(tmp_path):
    """A CUDA torch, nvcc found, every compile failing: the install succeeds as pure Python with one line saying
    why (the compiler's first error line and the log holding its whole output), and the NVRTC path is there."""
    src, target = _tree(tmp_path), tmp_path / "site"
    proc = _pip_install(src, target, _env(tmp_path, **_fake_cuda(tmp_path)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = _said(proc)
    assert len(said) == 1, said
    line = said[0]
    assert line.startswith("megakern: pure-Python install: the CUDA extension megakern._C did not build (")
    assert line.endswith("; the CUDA kernels compile at run time through cupy's NVRTC where it is installed; "
                         "MEGAKERN_REQUIRE_EXTENSION=1 makes this an error")
    reason = line.split("did not build (", 1)[1].split("; the compiler's output is in ", 1)[0]
    assert "fatal" in reason  # nvcc's error, or the host compiler's (no CUDA headers in the fake toolkit)
    log = Path(re.search(r"the compiler's output is in (\S+)\)", line)[1])
    assert log.parent == tmp_path / "tmp" and reason in log.read_text()
    assert "Traceback" in log.read_text()  # the whole story is in the log, not on the console
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not list(target.glob("megakern/_C*"))
    for name in _kernel_sources():
        assert (target / "megakern" / "_csrc" / name).is_file(), name
    _check_imports(target, tmp_path)


@pytest.mark.parametrize("how", ["build_ext", "MEGAKERN_REQUIRE_EXTENSION=1"])
def test_extension_asked_for_by_name_fails_loudly(tmp_path, how):
    src = _tree(tmp_path)
    env = _env(tmp_path, **_fake_cuda(tmp_path))
    if how == "build_ext":
        cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    else:
        cmd, env["MEGAKERN_REQUIRE_EXTENSION"] = [sys.executable, "setup.py", "build"], "1"
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert NVCC_ERROR in out or "fatal error" in out  # the compiler's own output, on the console
    assert not any("pure-Python install" in line for line in _said(proc))
    assert not list(src.rglob("_C*.so"))


def test_setup_switches_are_checked(tmp_path):
    src = _tree(tmp_path)

    def setup_py(*args, **env):
        return subprocess.run([sys.executable, "setup.py", *args], cwd=src, env=_env(tmp_path, **env),
                              capture_output=True, text=True, timeout=300)

    proc = setup_py("--version", MEGAKERN_PURE_PYTHON="yes")
    assert proc.returncode != 0
    assert "megakern: MEGAKERN_PURE_PYTHON='yes' is not a flag: set it to 1 or 0, or unset it" in proc.stderr
    proc = setup_py("--version", MEGAKERN_PURE_PYTHON="1", MEGAKERN_REQUIRE_EXTENSION="1")
    assert proc.returncode != 0 and "ask for opposite things; unset MEGAKERN_PURE_PYTHON" in proc.stderr
    proc = setup_py("build_ext", MEGAKERN_PURE_PYTHON="1")
    assert proc.returncode != 0 and "MEGAKERN_PURE_PYTHON=1 and `setup.py build_ext`" in proc.stderr
    proc = setup_py("--version", MEGAKERN_CUDA_ARCHS="sm_90", **_fake_cuda(tmp_path))
    assert proc.returncode != 0
    assert "MEGAKERN_CUDA_ARCHS='sm_90': expected compute capabilities such as '90a;80'" in proc.stderr
    # --no-build-isolation builds with the environment's setuptools: one too old for pyproject.toml is named
    old = tmp_path / "old-setuptools"
    old.mkdir()
    (old / "sitecustomize.py").write_text("import setuptools\nsetuptools.__version__ = '65.5.0'\n")
    proc = setup_py("--version", PYTHONPATH=str(old))
    assert proc.returncode != 0
    assert "megakern: building needs setuptools>=77, found 65.5.0 at " in proc.stderr
    assert "pip install -U 'setuptools>=77'" in proc.stderr


def _version() -> str:
    """megakern.__version__ as written in megakern/__init__.py (without importing the package)."""
    tree = ast.parse((ROOT / "megakern" / "__init__.py").read_text())
    return next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__version__"])


def test_sdist_carries_the_sources_and_installs_the_kernels(tmp_path):
    pytest.importorskip("build", reason="the sdist is made by `python -m build` (pip install -e '.[dev]')")
    src, dist = _tree(tmp_path), tmp_path / "dist"
    env = _env(tmp_path, MEGAKERN_PURE_PYTHON="1")
    proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist), str(src)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = dist.glob("megakern-*.tar.gz")
    assert sdist.name == f"megakern-{_version()}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    csrc = subprocess.run(["git", "ls-files", "csrc"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()
    assert csrc and not set(csrc) - names, sorted(set(csrc) - names)
    configs = [p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml")]
    assert configs and not set(configs) - names
    assert {"LICENSE", "README.md", "pyproject.toml", "setup.py", "megakern/__init__.py", "parallel/dims.py",
            "models/gpt.py"} <= names

    # A wheel built from the sdist (pip builds it from the unpacked archive) carries every kernel source.
    target = tmp_path / "site"
    proc = _pip_install(sdist, target, env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in _kernel_sources():
        assert (target / "megakern" / "_csrc" / name).is_file(), name
    (info,) = target.glob("megakern-*.dist-info")
    meta = email.message_from_string((info / "METADATA").read_text())
    assert meta["Name"] == "megakern" and meta["Version"] == _version()
    assert meta["License-Expression"] == "BSD-3-Clause" and (info / "licenses" / "LICENSE").is_file()
    project = _pyproject()["project"]
    assert meta["Requires-Python"] == project["requires-python"]
    assert meta.get_payload().startswith("# megakern")  # the README is the long description
    requires = meta.get_all("Requires-Dist")
    assert {r for r in requires if "extra ==" not in r} == set(project["dependencies"])
    assert set(meta.get_all("Provides-Extra")) == {"triton", "hf", "nvrtc-cu12", "nvrtc-cu13", "wandb", "bench", "dev"}
    entry_points = (info / "entry_points.txt").read_text()
    assert "megakern-train = megakern.train:main" in entry_points
    assert "megakern-export = megakern.models.export:main" in entry_points
    assert "megakern-generate = megakern.models.generate_cli:main" in entry_points


def test_metadata_lives_in_pyproject_only():
    """One version (megakern.__version__, read by setuptools), one layout; setup.py adds the extension and nothing
    that pyproject.toml declares."""
    pyproject = _pyproject()
    project, tool = pyproject["project"], pyproject["tool"]["setuptools"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert tool["dynamic"]["version"] == {"attr": "megakern.__version__"}
    assert project["scripts"] == {"megakern-train": "megakern.train:main",
                                  "megakern-export": "megakern.models.export:main",
                                  "megakern-generate": "megakern.models.generate_cli:main"}
    calls = [node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"]
    assert len(calls) == 1 and {k.arg for k in calls[0].keywords} == {"ext_modules", "cmdclass"}
    # every package directory of the tree is installed, under its name
    found = {}
    for top, name in PACKAGE_DIRS.items():
        for init in sorted((ROOT / top).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / top).parts
            found[".".join((name, *rel))] = "/".join((top, *rel))
    assert tool["package-dir"] == found and sorted(tool["packages"]) == sorted(found)


# Distributions of the modules megakern imports (pyproject.toml's names); cupy is either CUDA major's wheel.
DISTRIBUTIONS = {"yaml": "pyyaml", "liger_kernel": "liger-kernel", "cupy": "cupy-cuda12x"}


def _declared() -> set[str]:
    """Names of every distribution pyproject.toml declares, as a dependency or in an extra."""
    project = _pyproject()["project"]
    reqs = list(project["dependencies"])
    reqs += [r for extra in project["optional-dependencies"].values() for r in extra]
    return {re.match(r"[A-Za-z0-9_.-]+", r)[0].lower() for r in reqs}


def test_every_import_of_the_package_is_declared():
    """Each third-party module that megakern, megakern.parallel or megakern.models imports (at start-up or inside
    a function) is a declared dependency or part of an extra."""
    declared, missing = _declared(), {}
    for top in PACKAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in (m.split(".")[0] for m in modules):
                    if module in sys.stdlib_module_names or module in ("megakern", "__future__"):
                        continue
                    if DISTRIBUTIONS.get(module, module).replace("_", "-") not in declared:
                        missing.setdefault(module, path.relative_to(ROOT).as_posix())
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_no_module_edits_sys_path():
    """Contract 15 (../shared/ASSUMPTIONS.md): modules are found as installed packages, never by editing sys.path."""
    offenders = []
    for top in (*PACKAGE_DIRS, "benchmarks", "profiles"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                sys_path = (isinstance(node, ast.Attribute) and node.attr == "path"
                            and getattr(node.value, "id", "") == "sys")
                from_sys = isinstance(node, ast.ImportFrom) and node.module == "sys" and any(
                    a.name == "path" for a in node.names)
                site_dir = isinstance(node, ast.Attribute) and node.attr == "addsitedir"
                if sys_path or from_sys or site_dir:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_benchmarks_run_as_modules_and_as_scripts(tmp_path):
    """`python -m benchmarks.bench_x` from the repository root, and `python benchmarks/bench_x.py` (the script's
    folder first on the path, as Python puts it): every benchmark imports both ways without touching sys.path."""
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
    check = ("import importlib, runpy, sys\n"
             f"for name in {names!r}:\n"
             "    importlib.import_module('benchmarks.' + name)\n"
             "    runpy.run_path(f'benchmarks/{name}.py', run_name='as_script')\n"
             "print('ok', len(sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"),
                                                                     os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


def test_what_the_readme_commands_write_is_ignored():
    """The commands of the README and docs/ leave a checkout clean: what they write into it is ignored (run
    directories, profiles, docs/data.md's corpus and index caches, CPU benchmark rows given --out), the committed
    figures are not."""
    written = ["runs/20260101-120000/train.log", "profiles/train-4x128-cpu-20260101-120000/kernels.txt",
               "profiles/train-4x128-cpu-20260101-120000-rank1/trace.json", "profiles/gpt-tiny.nsys-rep",
               "data/corpus.bin", "data/index-cache/x.npy", "benchmarks/results/cpu/norm.csv", "build/lib/x.py",
               "megakern/_C.cpython-311-x86_64-linux-gnu.so", "megakern/_csrc/norm/norm.cu",
               "megakern.egg-info/PKG-INFO"]
    kept = ["benchmarks/results/h200/norm.csv", "profiles/h100/tune_rotary.txt", "profiles/tune_norm.py",
            "megakern/data/corpus.py", "configs/gpt-tiny.yaml", "tests/data/test_corpus.py"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *written, *kept], cwd=ROOT, capture_output=True,
                          text=True)
    assert sorted(proc.stdout.split()) == sorted(written), proc.stdout + proc.stderr


def test_subpackages_import():
    try:
        import megakern.models
        import megakern.parallel
    except ModuleNotFoundError as exc:
        pytest.skip(f"megakern is not installed (pip install -e .): {exc}")
    assert megakern.parallel.__doc__ and megakern.models.__doc__
