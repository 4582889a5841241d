"""The wheel as a user gets it: built with `python -m build`, installed into a fresh venv, and run.

Catches what an editable install hides: package data missing from the wheel (the compiled
layers' header), dependencies missing from pyproject, and a CLI that only works from a checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import make_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
WHEELS = Path.home() / ".cache" / "trtssd" / "wheels"  # llama-cpp-python has no wheel on PyPI
TORCH = "torch==2.13.0"  # the CPU build on local disk; an unpinned torch pulls a multi-GB CUDA build
# What a wheel build must not copy: environments, outputs, built engines.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    "results", ".cache")


def _run(cmd, env=None, timeout=300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd``; ``cwd`` away from the checkout, else `python -c` and `-m` would import the
    checkout's trtssd instead of the installed one."""
    done = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or Path.home())
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _pip_env() -> dict:
    """pip's own configuration, plus the local wheel folder (appended, not replacing the
    machine's find-links)."""
    links = " ".join(filter(None, [os.environ.get("PIP_FIND_LINKS", ""), str(WHEELS)]))
    return {**os.environ, "PIP_FIND_LINKS": links}


@pytest.mark.slow
@pytest.mark.skipif(not list(WHEELS.glob("llama_cpp_python-0.3.36-*.whl")),
                    reason=f"no llama-cpp-python 0.3.36 wheel in {WHEELS} (its sdist takes ~5 minutes to build)")
def test_the_wheel_installs_and_generates_in_a_fresh_venv(tmp_path):
    source = _source_tree(tmp_path / "src")
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", source], env=_pip_env())
    [wheel] = (tmp_path / "dist").glob("trtssd-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    python, env = venv / "bin" / "python", _pip_env()
    _run([python, "-m", "pip", "install", "-q", TORCH], env=env)
    _run([python, "-m", "pip", "install", "-q", wheel], env=env)

    version = _run([venv / "bin" / "trtssd", "--version"]).stdout.strip()
    assert version.startswith("trtssd ") and "unknown" not in version
    where = _run([python, "-c", "import importlib.resources as r, trtssd; print(trtssd.__file__); "
                  "print(r.files('trtssd.kernels').joinpath('int4_matmul.h').is_file())"]).stdout.split()
    assert where == [str(venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
                         / "trtssd" / "__init__.py"), "True"]  # the installed wheel's sources, header included

    engine = _tiny_engine(python, tmp_path)
    run_env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),  # a real first build, not left behind
               "TRTSSD_CALIBRATION_CACHE": str(tmp_path / "calibration"),
               "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    out = _run([venv / "bin" / "trtssd", "--log-level", "WARNING", "generate", "--engine", engine,
                "--max-tokens", "8", "--max-model-len", "128", "--prompt", "the cat"], env=run_env, timeout=400)
    assert "mode=ssd tokens=" in out.stdout  # the result line, on stdout
    assert "torch layers only" not in out.stderr, out.stderr  # the compiled layers built and loaded
    assert any((tmp_path / "ext").iterdir())


def _source_tree(dest: Path) -> Path:
    """The committed sources (a checkout: what CI builds, whatever is being edited in the working
    tree), else a copy of the tree; built there, never in the shared tree."""
    if (ROOT / ".git").exists():
        dest.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return dest
    return shutil.copytree(ROOT, dest, ignore=NOT_SOURCE)


def _tiny_engine(python: Path, tmp_path: Path) -> Path:
    """An int4 self-draft engine over a tiny random GGUF, built by the installed trtssd."""
    gguf_path = make_tiny_gguf(tmp_path / "Tiny.gguf")
    out = _run([python.parent / "trtssd", "build", "--target", gguf_path, "--out", tmp_path / "engines"],
               env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, timeout=400)
    return Path(out.stdout.strip().splitlines()[-1])
