#!/usr/bin/env bash
# Serving throughput and latency: `trtssd serve` on its ggml engines next to llama.cpp's
# llama-server on the same GGUF files and both cores, at concurrency 1, 2, 4, 8 and 16
# (16 chat prompts on /v1/chat/completions, greedy, --ignore-eos; `trtssd bench serve` drives
# every server the same way over HTTP):
#   trtssd-default:        the default mode (ssd under load control)
#   trtssd-ar:             plain decoding only (--mode ar)
#   trtssd-ar-batched:     --mode ar --no-row-invariant (llama.cpp's own batching, not bit-exact)
#   llama-server-defaults: as a user starts it: -m FILE -t 2 (its default slots: 4, each the model's
#                          context; prompt cache on), with --no-repack: this build's repacked kernels
#                          die on an illegal instruction on this machine's CPU
#   llama-server-16-slots: as configured before: 16 slots, a 32k context, no repacking, no prompt cache
# The trtssd servers take up to 16 sequences at once (--max-batch 16). Each server gets 20 s after
# it answers /health before it is measured. Writes one folder per engine beside itself
# (compare.md holds the tables); run on a quiet machine.
#   bash docs/bench/serve-vs-llama-server/run.sh [default-engine|qwen2.5-coder-1.5b]
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/serve-vs-llama-server
only=${1:-}
PORT=18451
llama_server=$(.venv/bin/python -c "from trtssd.bench.llamacpp import find_llama_server; print(find_llama_server() or '')")
[[ -x "$llama_server" ]] || { echo "llama-server not built: bash scripts/setup_llamacpp.sh tools" >&2; exit 1; }
.venv/bin/trtssd build --backend ggml >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
pid=""
stop() { if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
load() {  # out, label, bench args...
  local out=$1 label=$2; shift 2
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  sleep 20
  .venv/bin/trtssd bench serve --ignore-eos --label "$label" --out "$out/$label" --no-plots \
    --base-url "http://127.0.0.1:$PORT" --concurrency 1,2,4,8,16 --datasets chat \
    --endpoint /v1/chat/completions "$@"
  stop
}
trtssd() {  # out, label, serve args... -- bench args...
  local out=$1 label=$2; shift 2
  local serve=()
  while [[ $1 != -- ]]; do serve+=("$1"); shift; done
  shift
  .venv/bin/trtssd serve --port "$PORT" --max-batch 16 "${serve[@]}" >"$out/$label.log" 2>&1 &
  pid=$!; load "$out" "$label" "$@"
}
llama() {  # out, label, gguf, server args... -- bench args...
  local out=$1 label=$2 gguf=$3; shift 3
  local serve=()
  while [[ $1 != -- ]]; do serve+=("$1"); shift; done
  shift
  "$llama_server" -m "$gguf" --host 127.0.0.1 --port "$PORT" -t 2 -tb 2 --no-webui "${serve[@]}" \
    >"$out/$label.log" 2>&1 &
  pid=$!; load "$out" "$label" "$@"
}
engine() {  # name, engine dir, bench args...
  local name=$1 dir=$2; shift 2
  [[ -z "$only" || "$only" == "$name" ]] || return 0
  local out=$here/$name gguf=$dir/target/model.gguf
  mkdir -p "$out"
  trtssd "$out" trtssd-default --engine "$dir" -- "$@"
  trtssd "$out" trtssd-ar --engine "$dir" --mode ar -- "$@"
  trtssd "$out" trtssd-ar-batched --engine "$dir" --mode ar --no-row-invariant -- "$@"
  llama "$out" llama-server-defaults "$gguf" --no-repack -- "$@"
  llama "$out" llama-server-16-slots "$gguf" --parallel 16 -c 32768 --no-repack --no-cache-prompt -- "$@"
  .venv/bin/trtssd bench serve --compare "$out"/trtssd-default "$out"/trtssd-ar "$out"/trtssd-ar-batched \
    "$out"/llama-server-defaults "$out"/llama-server-16-slots --out "$out"
}
engine default-engine engines/smollm2-135m-ggml --num-prompts 16 --max-tokens 64
engine qwen2.5-coder-1.5b engines/qwen2.5-coder-1.5b-ggml --num-prompts 16 --max-tokens 32
