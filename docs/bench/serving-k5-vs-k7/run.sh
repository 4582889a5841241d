#!/usr/bin/env bash
# Serving: `trtssd serve` in ar mode, ssd with K = 5 and ssd with K = 7 on the default engine,
# at concurrency 1,2,4,8,16 (16 requests x 64 tokens per point, greedy), side by side.
#   bash docs/bench/serving-k5-vs-k7/run.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-docs/bench/serving-k5-vs-k7}
PORT=18441
pid=""
stop() { [[ -n "$pid" ]] && { kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; }; }
trap stop EXIT
run() {  # label, serve args...
  local label=$1; shift
  .venv/bin/trtssd serve --port "$PORT" "$@" >"$OUT/$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  .venv/bin/trtssd bench serve --num-prompts 16 --max-tokens 64 --ignore-eos --label "$label" --out "$OUT/$label" \
    --base-url "http://127.0.0.1:$PORT" --concurrency 1,2,4,8,16
  stop
}
mkdir -p "$OUT"
run serve-ar --mode ar
run serve-ssd-k5 --mode ssd --k 5
run serve-ssd-k7 --mode ssd --k 7
.venv/bin/trtssd bench serve --compare "$OUT/serve-ar" "$OUT/serve-ssd-k5" "$OUT/serve-ssd-k7" --out "$OUT"
