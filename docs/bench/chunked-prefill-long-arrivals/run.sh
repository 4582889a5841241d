#!/usr/bin/env bash
# Chunked prefill under load: `trtssd serve` on an engine (default: the default engine), 8 short
# chat streams back to back for 90 s (greedy, 32 tokens each) while a 900-word prompt (a new one
# each time: nothing to reuse) arrives every 8 s. The short streams' inter-token latency with
# whole-prompt prefill (--prefill-chunk 0) and with chunks of 256 tokens (the default), in ar and in
# ssd with every round speculating (--no-plain-under-load: load control's choice between plain and
# speculative rounds changes a delta's size, which would blur the comparison); then ssd with chunks
# of 128 and of 512 (how the default was chosen).
#   bash docs/bench/chunked-prefill-long-arrivals/run.sh [ENGINE_DIR]
# Writes one folder per run (result.{json,md}), the servers' logs and compare.md beside itself;
# run on a quiet machine.
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
  .venv/bin/trtssd serve --port "$PORT" --max-batch 9 --max-model-len 2048 ${engine:+--engine "$engine"} \
    "$@" >"$here/$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  .venv/bin/trtssd bench prefill --scenario arrivals --label "$label" --out "$here/$label" \
    --base-url "http://127.0.0.1:$PORT" --concurrency 8 --duration-s 90 --long-every-s 8 --long-words 900 \
    --max-tokens 32
  stop
}
run ar-whole --mode ar --prefill-chunk 0
run ar-chunk-256 --mode ar
run ssd-whole --mode ssd --no-plain-under-load --prefill-chunk 0
run ssd-chunk-256 --mode ssd --no-plain-under-load
run ssd-chunk-128 --mode ssd --no-plain-under-load --prefill-chunk 128
run ssd-chunk-512 --mode ssd --no-plain-under-load --prefill-chunk 512
.venv/bin/python docs/bench/chunked-prefill-long-arrivals/table.py
