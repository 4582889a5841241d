#!/usr/bin/env bash
# Concurrency 1 again, twice, alternating `trtssd serve --mode ar` and `--mode ssd` on the default
# engine as it now ships (K = 7 from its manifest): 16 requests x 64 tokens each, greedy.
#   bash docs/bench/serving-k5-vs-k7/c1-repeats.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-docs/bench/serving-k5-vs-k7/c1-repeats}
PORT=18442
pid=""
stop() { [[ -n "$pid" ]] && { kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; }; }
trap stop EXIT
run() {  # label, mode
  .venv/bin/trtssd serve --port "$PORT" --mode "$2" >"$OUT/$1.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  .venv/bin/trtssd bench serve --num-prompts 16 --max-tokens 64 --ignore-eos --label "$1" --out "$OUT/$1" \
    --base-url "http://127.0.0.1:$PORT" --concurrency 1
  stop
}
mkdir -p "$OUT"
for rep in 1 2; do
  run "ar-$rep" ar
  run "ssd-$rep" ssd
done
.venv/bin/trtssd bench serve --compare "$OUT/ar-1" "$OUT/ssd-1" "$OUT/ar-2" "$OUT/ssd-2" --out "$OUT"
