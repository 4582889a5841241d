#!/usr/bin/env bash
# Creates .venv (if missing) and installs trtssd with what the tests and the demo need.
# On CPU machines torch is pinned to 2.13.0: an unpinned torch would pull a multi-GB CUDA build.
# llama.cpp is compiled once per machine by setup_llamacpp.sh (cached in ~/.cache/trtssd); its
# peer tools (llama-server, llama-bench) are built from the same build when a benchmark needs them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.trtssd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  start=$(date +%s)
  say "installing Python packages into .venv (log: .venv/setup.log)"
  log=.venv/setup.log
  # pip's output goes to the log, shown only when a step fails.
  pip_quiet() { .venv/bin/python -m pip install -q "$@" >>"$log" 2>&1 || { tail -30 "$log" >&2; say "ERROR: pip install $* failed"; exit 1; }; }
  : >"$log"
  pip_quiet --upgrade pip
  pip_quiet "torch==2.13.0"
  # Before trtssd: it depends on llama-cpp-python, which PyPI has only as source.
  bash scripts/setup_llamacpp.sh >/dev/null
  pip_quiet -e ".[test,kernels]"
  .venv/bin/python -c "import trtssd" || { say "ERROR: trtssd does not import after the install"; exit 1; }
  touch "$stamp"
  say "set up in $(( $(date +%s) - start )) s"
else
  bash scripts/setup_llamacpp.sh >/dev/null  # cached: only checks the stamps
fi
