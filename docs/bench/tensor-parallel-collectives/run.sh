#!/usr/bin/env bash
# What a tensor-parallel target's collectives cost per forward on this machine's CPUs: gloo
# all-reduce of the hidden state and all-gather of the logits between T processes, for the
# default engine's shape (SmolLM2-135M: hidden 576, vocab 49152, 30 layers) and the Qwen2.5-Coder
# 1.5B target's (hidden 1536, vocab 151936, 28 layers), T = 2. Writes collectives.json (input of
# `trtssd plan --collectives`) and results.md per shape. Run on a quiet machine; REPEATS=N to change
# the timed calls per size (default 200).
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/tensor-parallel-collectives
repeats=${REPEATS:-200}
.venv/bin/python "$here/measure.py" --size 2 --hidden 576 --vocab 49152 --layers 30 --repeats "$repeats" \
  --out "$here/smollm2-135m-t2"
.venv/bin/python "$here/measure.py" --size 2 --hidden 1536 --vocab 151936 --layers 28 --repeats "$repeats" \
  --out "$here/qwen2.5-coder-1.5b-t2"
