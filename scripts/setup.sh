#!/usr/bin/env bash
# Creates .venv (if missing) and installs trtssd with what the tests and the demo need.
# On CPU machines torch is pinned to 2.13.0: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.trtssd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # llama-cpp-python has no binary wheel on PyPI: setup_llamacpp.sh builds it once per machine
  # (cached in ~/.cache/trtssd/wheels) before trtssd, which depends on it, is installed.
  bash scripts/setup_llamacpp.sh >/dev/null
  PIP_FIND_LINKS="${PIP_FIND_LINKS:-} $HOME/.cache/trtssd/wheels" .venv/bin/python -m pip install -q -e ".[test,kernels]"
  touch "$stamp"
fi
bash scripts/setup_llamacpp.sh >/dev/null  # llama.cpp's executables + llama-cpp-python, cached per machine
