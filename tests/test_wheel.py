"""A real install: build the wheel, install it in a fresh venv, import it and run `k3batch` there.

Two installs of the one wheel (built offline with this venv's setuptools: `pip wheel --no-deps
--no-build-isolation`):
- `installed`, offline: `--no-deps --no-index`; the fresh venv then sees this venv's
  dependencies (torch, ray, the extras) through a .pth file of path lines, which does not run
  this venv's own .pth files, so the editable k3batch of the test venv stays invisible there.
  Every module imports from it.
- `plain`: what a user gets from `pip install k3batch` with no extras on a CPU machine, the CPU
  build of torch first (`pip install torch==2.13.0`), then the wheel with its dependencies
  from the package index (pip's cache after `make setup`): no triton, no fla. Every module
  that does not need them imports, and a tiny job runs to the end there (issue 50: the CPU
  path imported triton, and the job looped forever on the replica's ImportError).

Fails before the fix: pyproject.toml listed its packages by hand and left out k3batch.actors and
k3batch.parallel (delete "k3batch.actors" from the list and both tests below fail).
"""

import importlib.util
import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOTS = {"k3batch": REPO / "k3batch", "k3kernels": REPO / "kernels"}  # import name: folder


def _source_packages() -> set[str]:
    """Each folder with an __init__.py under k3batch/ and kernels/, by import name."""
    names = set()
    for name, root in PACKAGE_ROOTS.items():
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if "__pycache__" not in parts:
                names.add(".".join((name, *parts)))
    return names


def test_pyproject_lists_every_package():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    missing, extra = _source_packages() - listed, listed - _source_packages()
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"
    assert not extra, f"pyproject.toml lists packages that have no folder: {extra}"


def _run(cmd, *, cwd, timeout=300, env=None) -> str:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built offline from a copy of its sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: building in place would leave build/ and egg-info in the checkout
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in PACKAGE_ROOTS.values():
        shutil.copytree(folder, src / folder.name, ignore=skip)
    _run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
         cwd=tmp)  # fmt: skip
    (built,) = (tmp / "dist").glob("k3batch-*.whl")
    return built


PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A fresh venv holding the built wheel, seeing this venv's packages; its bin/ folder."""
    tmp = tmp_path_factory.mktemp("installed")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    py = venv / "bin" / "python"
    _run([*PIP, "--python", str(py), "install", "--no-deps", "--no-index", str(wheel)], cwd=tmp)
    # Only now the test venv's packages become visible (pip must not see its editable k3batch).
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp)
    # Not the checkout itself (its k3batch would shadow the wheel's), but the test venv may sit
    # inside it (.venv): only the source folders and the checkout's root are left out.
    ours = {Path(sysconfig.get_path("stdlib")).resolve(), *PACKAGE_ROOTS.values()}
    deps = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != REPO]
    deps = [p for p in deps if not any(Path(p).resolve().is_relative_to(o) for o in ours)]
    (Path(site.strip()) / "zz_test_venv_deps.pth").write_text("\n".join(deps) + "\n")
    return venv / "bin"


@pytest.fixture(scope="module")
def plain(wheel, tmp_path_factory):
    """A fresh venv with the CPU build of torch and the wheel with its own dependencies, no
    extras (about 90 s from pip's cache); its bin/ folder."""
    tmp = tmp_path_factory.mktemp("plain")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "install", "torch==2.13.0"], cwd=tmp, timeout=600)  # the local CPU build
    _run([*pip, "install", str(wheel)], cwd=tmp, timeout=900)
    return venv / "bin"


# Modules that import an optional extra at import time: module -> the extra's import name.
# `make test` installs the extras, so CI imports them all; a venv without one leaves its module out.
OPTIONAL = {"k3batch.eval.harness": "lm_eval"}


def _all_modules() -> list[str]:
    out = []
    for name, root in PACKAGE_ROOTS.items():
        out.append(name)
        out += [m.name for m in pkgutil.walk_packages([str(root)], prefix=f"{name}.")]
    missing = {m for m, dep in OPTIONAL.items() if importlib.util.find_spec(dep) is None}
    return sorted(set(out) - missing)


@pytest.mark.slow
def test_wheel_imports_every_module_and_runs_cli(installed, tmp_path):
    modules = _all_modules()
    assert "k3batch.actors.replica" in modules and "k3batch.parallel.group" in modules
    code = (
        "import importlib, sys\n"
        f"mods = {modules!r}\n"
        "for m in mods:\n"
        "    f = importlib.import_module(m).__file__\n"
        "    assert f.startswith(sys.prefix), (m, f)\n"  # from the wheel, not the checkout
        "print('imported', len(mods))\n"
    )
    out = _run([str(installed / "python"), "-c", code], cwd=tmp_path)
    assert f"imported {len(modules)}" in out
    help_ = _run([str(installed / "k3batch"), "run", "--help"], cwd=tmp_path)
    assert "--batch-rows" in help_


# What needs the `fla` extra (triton, fla) and runs only on a GPU: the Triton kernels and the
# routed-expert benchmark. Everything else imports without them.
GPU_ONLY = {"k3batch.bench.moe", "k3kernels.pdl"} | {
    f"k3kernels.{p}" for p in ("attn_res.mix", "kda.chunk_state", "kda.conv_decode",
                               "kda.conv_prefill", "kda.recurrent_decode", "mla.decode",
                               "mla.merge", "mla.prefill", "moe.act", "moe.combine",
                               "moe.grouped_gemm_triton", "moe.interleave", "moe.route",
                               "moe.w4a16", "moe.w4a16_decode", "norm.rms_norm")
}  # fmt: skip


@pytest.mark.slow
def test_plain_install_imports_all_but_gpu_kernels(plain, tmp_path):
    modules = [m for m in _all_modules() if m not in GPU_ONLY and m not in OPTIONAL]
    code = (
        "import importlib, importlib.util, sys\n"
        "assert importlib.util.find_spec('triton') is None, 'triton is installed'\n"
        "assert importlib.util.find_spec('fla') is None, 'fla is installed'\n"
        f"mods = {modules!r}\n"
        "for m in mods:\n"
        "    f = importlib.import_module(m).__file__\n"
        "    assert f.startswith(sys.prefix), (m, f)\n"
        "print('imported', len(mods))\n"
    )
    assert f"imported {len(modules)}" in _run([str(plain / "python"), "-c", code], cwd=tmp_path)


@pytest.mark.slow
def test_plain_install_runs_a_tiny_job(plain, tmp_path):
    """The plain install's `k3batch` writes a checkpoint and runs a job on a local Ray to the
    end, on CPU torch without triton or fla (~1 min)."""
    k3 = str(plain / "k3batch")
    _run([k3, "init-checkpoint", "--flavor", "k3-debug", "ckpt"], cwd=tmp_path)
    pq.write_table(pa.table({"prompt": ["hello", "kimi linear"]}), tmp_path / "in.parquet")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    _run([k3, "run", "--model", "ckpt", "--input", "in.parquet", "--output", "out",
          "--device", "cpu", "--max-new-tokens", "2", "--temperature", "0", "--max-seq-len", "64",
          "--chunk-size", "32"], cwd=tmp_path, timeout=240, env=env)  # fmt: skip
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert len(rows) == 2 and all(r["error"] is None for r in rows)
