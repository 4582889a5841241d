#!/usr/bin/env bash
# The serving benchmark of README "Serving": `trtssd serve` in ssd mode and in ar mode at
# concurrency 1,2,4,8,16, then the same engine behind Triton's generate_stream at concurrency 1
# and 8, all with `trtssd bench serve`, side by side in $OUT/compare.md (+ .json, .png).
#
#   bash scripts/bench_serving.sh [OUT]        # default docs/bench/serving
#
# Run it on a quiet machine (SSD needs both cores); the load average is recorded in every result.
# Knobs: ENGINE (default: the embedded engine), NUM_PROMPTS (16), MAX_TOKENS (64), CONCURRENCY
# (1,2,4,8,16), TRITON_CONCURRENCY (1,8), SKIP_TRITON=1.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench/serving}
NUM_PROMPTS=${NUM_PROMPTS:-16}
MAX_TOKENS=${MAX_TOKENS:-64}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16}
TRITON_CONCURRENCY=${TRITON_CONCURRENCY:-1,8}
ENGINE_ARGS=()
[[ -n "${ENGINE:-}" ]] && ENGINE_ARGS=(--engine "$ENGINE")
PY=.venv/bin/python
TRTSSD=.venv/bin/trtssd
PORT=18431
TRITON_HTTP=18432
TRITON_GRPC=18433
TRITON_METRICS=18434
mkdir -p "$OUT"
server_pid=""

stop_server() {
  if [[ -n "$server_pid" ]]; then
    kill -INT "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  fi
}
trap stop_server EXIT

wait_ready() {  # url, seconds
  local deadline=$((SECONDS + $2))
  until curl -sf "$1" >/dev/null; do
    if (( SECONDS > deadline )) || ! kill -0 "$server_pid" 2>/dev/null; then
      echo "server at $1 did not become ready" >&2
      return 1
    fi
    sleep 1
  done
}

bench() {  # label, extra args...
  local label=$1; shift
  "$TRTSSD" bench serve --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --ignore-eos \
    --label "$label" --out "$OUT/$label" "$@"
}

for mode in ssd ar; do
  "$TRTSSD" serve "${ENGINE_ARGS[@]}" --mode "$mode" --port "$PORT" >"$OUT/serve-$mode.log" 2>&1 &
  server_pid=$!
  wait_ready "http://127.0.0.1:$PORT/health" 300
  bench "serve-$mode" --base-url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY"
  stop_server
done

# ar first: the comparison divides every other column by the first one (ssd / ar).
dirs=("$OUT/serve-ar" "$OUT/serve-ssd")
if [[ "${SKIP_TRITON:-0}" != 1 ]]; then
  for mode in ssd ar; do
    repo=$(mktemp -d)
    "$TRTSSD" triton-repo --out "$repo" "${ENGINE_ARGS[@]}" --mode "$mode" >/dev/null
    "$TRTSSD" triton-serve "$repo" --http-port "$TRITON_HTTP" --grpc-port "$TRITON_GRPC" \
      --metrics-port "$TRITON_METRICS" >"$OUT/triton-$mode.log" 2>&1 &
    server_pid=$!
    wait_ready "http://127.0.0.1:$TRITON_HTTP/v2/models/trtssd/ready" 300
    bench "triton-$mode" --backend triton --base-url "http://127.0.0.1:$TRITON_HTTP" \
      --metrics-url "http://127.0.0.1:$TRITON_METRICS/metrics" --concurrency "$TRITON_CONCURRENCY"
    stop_server
    rm -rf "$repo"
    dirs+=("$OUT/triton-$mode")
  done
fi
"$TRTSSD" bench serve --compare "${dirs[@]}" --out "$OUT"
