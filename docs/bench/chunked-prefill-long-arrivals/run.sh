#!/usr/bin/env bash
# Chunked prefill under load: `trtssd serve` on an engine (default: the default engine) in ssd
# mode, 8 short chat streams back to back for 90 s (greedy, 32 tokens each) while a 900-word
# prompt (a new one each time: nothing to reuse) arrives every 8 s. Inter-token latency of the
# short streams with whole-prompt prefill (--prefill-chunk 0) and with chunks of 256 tokens (the
# default), alternating twice; then chunks of 128 and of 512 once each (how the default was chosen).
#   bash docs/bench/chunked-prefill-long-arrivals/run.sh [ENGINE_DIR]
# Writes {whole,chunk-256}-{1,2}, chunk-128 and chunk-512 (result.{json,md} each) and the servers' logs beside itself; run on a
# quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/chunked-prefill-long-arrivals
engine=${1:-}
PORT=18462
pid=""
stop() { if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
run() {  # label, serve options...
  local label=$1; shift
  .venv/bin/trtssd serve --port "$PORT" --mode ssd --max-batch 9 --max-seq-len 2048 ${engine:+--engine "$engine"} \
    "$@" >"$here/$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  .venv/bin/trtssd bench prefill --scenario arrivals --label "$label" --out "$here/$label" \
    --base-url "http://127.0.0.1:$PORT" --concurrency 8 --duration-s 90 --long-every-s 8 --long-words 900 \
    --max-tokens 32
  stop
}
for rep in 1 2; do
  run "whole-$rep" --prefill-chunk 0
  run "chunk-256-$rep"
done
run chunk-128 --prefill-chunk 128
run chunk-512 --prefill-chunk 512
