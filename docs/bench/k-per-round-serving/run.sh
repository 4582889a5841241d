#!/usr/bin/env bash
# K per round against fixed K: `trtssd serve --mode ssd` on the default engine with K = 3, 5 and
# 7, and with K per round (K = 7, verifying 1..7 each round), at concurrency 1, 2, 4, 8 and 16
# (16 requests x 64 tokens per point, greedy, ignore_eos), side by side.
#   bash docs/bench/k-per-round-serving/run.sh
# Writes one folder per server, their logs and compare.{md,json,png} beside itself; run on a quiet
# machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/k-per-round-serving
PORT=18463
pid=""
stop() { if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
run() {  # label, serve options...
  local label=$1; shift
  .venv/bin/trtssd serve --port "$PORT" --mode ssd --max-batch 16 "$@" >"$here/$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  .venv/bin/trtssd bench serve --ignore-eos --label "$label" --out "$here/$label" \
    --base-url "http://127.0.0.1:$PORT" --concurrency 1,2,4,8,16 --num-prompts 16 --max-tokens 64
  stop
}
run k3 --k 3
run k5 --k 5
run k7 --k 7
run k-per-round --k 7 --k-per-round
.venv/bin/trtssd bench serve --compare "$here/k3" "$here/k5" "$here/k7" "$here/k-per-round" --out "$here"
