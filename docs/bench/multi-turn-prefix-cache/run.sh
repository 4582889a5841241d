#!/usr/bin/env bash
# Multi-turn chat with and without prefix caching: `trtssd serve` on an engine (default: the
# default engine) in ssd mode, 3 sessions x 8 turns sharing a 600-word system prompt, each turn
# streamed (greedy, 32 tokens), sessions one after another; time to first token by turn.
# The server without the cache (--prefix-cache-seqs 0) and with it (the default) alternate twice.
#   bash docs/bench/multi-turn-prefix-cache/run.sh [ENGINE_DIR]
# Writes {cache-off,cache-on}-{1,2}/result.{json,md} and the servers' logs beside itself; run on a
# quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/multi-turn-prefix-cache
engine=${1:-}
PORT=18461
pid=""
stop() { if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
run() {  # label, serve options...
  local label=$1; shift
  .venv/bin/trtssd serve --port "$PORT" --mode ssd ${engine:+--engine "$engine"} "$@" >"$here/$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  .venv/bin/trtssd bench prefill --scenario turns --label "$label" --out "$here/$label" \
    --base-url "http://127.0.0.1:$PORT" --sessions 3 --turns 8 --system-words 600 --max-tokens 32
  stop
}
for rep in 1 2; do
  run "cache-off-$rep" --prefix-cache-seqs 0
  run "cache-on-$rep"
done
.venv/bin/python docs/bench/multi-turn-prefix-cache/table.py
