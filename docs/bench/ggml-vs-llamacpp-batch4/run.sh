#!/usr/bin/env bash
# trtssd on its ggml engines next to llama.cpp's llama-server, batch 4 (four requests decoded
# together; llama-server with four slots), HumanEval + chat + math, tok/s including prefill.
#  default-engine/: greedy and temperature 0.8; trtssd ar (both cores, exact rows), ssd (one core
#    per rank), auto (ssd under load control); llama.cpp on 2 threads.
#  qwen2.5-coder-1.5b/: greedy; the same systems and llama.cpp's sd with the 0.5B draft.
#  qwen2.5-coder-1.5b-t0.8/: temperature 0.8; trtssd ar and ssd, llama.cpp and its sd (auto is
#    ssd at temperature 0.8: the harness seeds every request, and a seeded request keeps its
#    batch speculating).
# Writes one folder per part beside itself; run it on a quiet machine.
#   bash docs/bench/ggml-vs-llamacpp-batch4/run.sh [default|qwen|qwen-t0.8 ...]   (default: all parts)
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/ggml-vs-llamacpp-batch4
.venv/bin/trtssd build --backend ggml >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
common=(--datasets humaneval,chat,math --batch 4 --prompts 4 --no-calibrate --no-plots --llamacpp-threads 2)
bench() { .venv/bin/trtssd bench "${common[@]}" "$@"; }
parts=("${@:-default qwen qwen-t0.8}")
for part in ${parts[*]}; do
  case $part in
    default) bench --engine engines/smollm2-135m-ggml --max-tokens 96 --k 7 --temperature 0,0.8 \
               --systems ar,ssd,auto,llama.cpp --out "$here/default-engine" ;;
    qwen) bench --engine engines/qwen2.5-coder-1.5b-ggml --max-tokens 64 --k 3 --temperature 0 \
            --systems ar,ssd,auto,llama.cpp,llama.cpp-sd --out "$here/qwen2.5-coder-1.5b" ;;
    qwen-t0.8) bench --engine engines/qwen2.5-coder-1.5b-ggml --max-tokens 64 --k 3 --temperature 0.8 \
                 --systems ar,ssd,llama.cpp,llama.cpp-sd --out "$here/qwen2.5-coder-1.5b-t0.8" ;;
    *) echo "unknown part $part (default, qwen, qwen-t0.8)" >&2; exit 2 ;;
  esac
done
