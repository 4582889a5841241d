#!/usr/bin/env bash
# What `n` and the penalties cost at concurrency 1: `trtssd serve` on the default engine
# (engines/smollm2-135m-ggml, its default mode), then measure.py: one request with n = 8 against 8
# separate requests of the same prompt sent at once (time to first token, tokens/s), and one
# request with presence_penalty 0.5, frequency_penalty 0.5, repetition_penalty 1.1 and a few
# logit_bias ids against the same request without them (time per output token). Writes
# results.json and results.md (with the load average) and the server's log beside itself. Run on
# a quiet machine:
#   bash docs/bench/n-samples-and-penalties/run.sh              (a few minutes)
#   bash docs/bench/n-samples-and-penalties/run.sh --quick      (a check that it runs end to end; not a measurement)
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/n-samples-and-penalties
PORT=18471
measure=()
out=$here
if [[ "${1:-}" == "--quick" ]]; then
  out=$(mktemp -d)
  measure=(--max-tokens 4 --prompt-words 40 --repetitions 1 --out "$out")
fi
pid=""
stop() { if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
.venv/bin/trtssd build --backend ggml >/dev/null
serve=(.venv/bin/trtssd serve --port "$PORT" --engine engines/smollm2-135m-ggml --max-batch 8)
"${serve[@]}" >"$out/server.log" 2>&1 &
pid=$!
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
.venv/bin/python "$here/measure.py" --base-url "http://127.0.0.1:$PORT" --server "trtssd ${serve[*]:1}" "${measure[@]}"
stop
echo "results in $out"
