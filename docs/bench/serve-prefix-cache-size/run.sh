#!/usr/bin/env bash
# How many finished prompts the prefix cache keeps, on the benchmark next to llama-server: the same
# 16 chat prompts sent at every concurrency (as docs/bench/serve-vs-llama-server/run.sh sends them),
# `trtssd serve --mode ar` on the default engine with --prefix-cache-seqs 8, 32 and unset (the
# default: as many as --prefix-cache-mib holds), alternated, each server settled 15 s, at concurrency 1, 2, 4 (64 tokens, greedy, EOS ignored).
# Each run's prefix-cache counters are read from /metrics. Quiet machine only.
#   bash docs/bench/serve-prefix-cache-size/run.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/serve-prefix-cache-size
rounds=${1:-1}
PORT=18469
pid=""
stop() { if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
rm -rf "$here"/runs && mkdir -p "$here"/runs
for round in $(seq "$rounds"); do
  for seqs in 8 32 unset; do
    label=prefix-cache-seqs-$seqs-$round
    size=(); [[ $seqs == unset ]] || size=(--prefix-cache-seqs "$seqs")
    .venv/bin/trtssd serve --port $PORT --max-batch 16 --mode ar "${size[@]}" \
      --engine engines/smollm2-135m-ggml >"$here/runs/$label.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
    sleep 15
    .venv/bin/trtssd bench serve --ignore-eos --label "$label" --out "$here/runs/$label" --no-plots \
      --base-url "http://127.0.0.1:$PORT" --concurrency 1,2,4 --datasets chat \
      --endpoint /v1/chat/completions --num-prompts 16 --max-tokens 64
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^vllm:(prompt_tokens|prefix_cache_hits|prefix_cache_queries)_total" \
      > "$here/runs/$label/prefix-cache.txt"
    stop
  done
done
