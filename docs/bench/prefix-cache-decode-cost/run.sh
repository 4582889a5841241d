#!/usr/bin/env bash
# What the prefix cache costs decoding on the ggml engine when no prompt repeats: `trtssd serve`
# on the default ggml engine in its default mode, 16 distinct prompts x 64 tokens (greedy,
# --ignore-eos) at concurrency 1, 4 and 16, with the prefix cache (the default, 8 prompts kept)
# and without it (--prefix-cache-seqs 0), alternated (on, off, off, on) in one run so that drift
# of the machine falls on both. llama.cpp keeps one cache for every sequence and every forward
# attends over all its cells (masked), so the prefix cache copies a finished prompt's cells to host
# memory and lays them back only when a later prompt starts with it; this measures what is left of
# the cost. Each server gets 30 s after it answers /health before it is measured. Run on a quiet
# machine:
#   bash docs/bench/prefix-cache-decode-cost/run.sh        (about 8 minutes)
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/prefix-cache-decode-cost
PORT=18453
pid=""
stop() { if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
.venv/bin/trtssd build --backend ggml >/dev/null
run() {  # label, extra serve options
  local label=$1
  shift
  .venv/bin/trtssd serve --port "$PORT" --engine engines/smollm2-135m-ggml --max-batch 16 "$@" \
    >"$here/$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  sleep 30
  .venv/bin/trtssd bench serve --ignore-eos --label "$label" --out "$here/$label" \
    --base-url "http://127.0.0.1:$PORT" --concurrency 1,4,16 --num-prompts 16 --max-tokens 64
  stop
}
run cache-1
run no-cache-1 --prefix-cache-seqs 0
run no-cache-2 --prefix-cache-seqs 0
run cache-2
.venv/bin/trtssd bench serve --compare "$here/cache-1" "$here/no-cache-1" "$here/no-cache-2" "$here/cache-2" --out "$here"
