#!/usr/bin/env bash
# Serving throughput and latency: `trtssd serve` on its ggml engines next to llama.cpp's
# llama-server on the same GGUF files and both cores, at concurrency 1, 2, 4, 8 and 16
# (greedy, --ignore-eos; `trtssd bench serve` drives every server the same way over HTTP).
#   trtssd-ssd: the default mode (ssd under load control: plain rounds where they measure faster)
#   trtssd-ar:  plain decoding only
#   llama-server: 2 threads, 16 slots (--parallel 16), continuous batching, no prompt cache
# Both trtssd servers take up to 16 sequences at once (--max-batch 16). Each server gets 30 s
# after it answers /health before it is measured.
# Writes one folder per engine beside itself (compare.md holds the tables); run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/serve-vs-llama-server
PORT=18451
llama_server=$(.venv/bin/python -c "from trtssd.bench.llamacpp import find_llama_server; print(find_llama_server() or '')")
[[ -x "$llama_server" ]] || { echo "llama-server not built: bash scripts/setup.sh" >&2; exit 1; }
.venv/bin/trtssd build --backend ggml >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
pid=""
stop() { [[ -n "$pid" ]] && { kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; }; }
trap stop EXIT
load() {  # out, label, bench args...
  local out=$1 label=$2; shift 2
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  sleep 30  # every server settles first: here the first ~20 s after a start decode up to 1.4x slower
  .venv/bin/trtssd bench serve --ignore-eos --label "$label" --out "$out/$label" \
    --base-url "http://127.0.0.1:$PORT" --concurrency 1,2,4,8,16 "$@"
  stop
}
engine() {  # name, engine dir, gguf, bench args...
  local name=$1 dir=$2 gguf=$3; shift 3
  local out=$here/$name
  mkdir -p "$out"
  .venv/bin/trtssd serve --port "$PORT" --engine "$dir" --max-batch 16 >"$out/trtssd-ssd.log" 2>&1 &
  pid=$!; load "$out" trtssd-ssd "$@"
  .venv/bin/trtssd serve --port "$PORT" --engine "$dir" --max-batch 16 --mode ar >"$out/trtssd-ar.log" 2>&1 &
  pid=$!; load "$out" trtssd-ar "$@"
  "$llama_server" -m "$gguf" --host 127.0.0.1 --port "$PORT" -t 2 -tb 2 --parallel 16 -c 32768 \
    --no-repack --no-webui --no-cache-prompt >"$out/llama-server.log" 2>&1 &
  pid=$!; load "$out" llama-server "$@"
  .venv/bin/trtssd bench serve --compare "$out/trtssd-ssd" "$out/trtssd-ar" "$out/llama-server" --out "$out"
}
engine default-engine engines/smollm2-135m-ggml engines/smollm2-135m-ggml/target/model.gguf --num-prompts 16 --max-tokens 64
engine qwen2.5-coder-1.5b engines/qwen2.5-coder-1.5b-ggml engines/qwen2.5-coder-1.5b-ggml/target/model.gguf --num-prompts 16 --max-tokens 32
