#!/usr/bin/env bash
# trtssd on its ggml engines next to llama.cpp's llama-server on the same GGUF files and cores:
# batch 1, HumanEval + chat + math prompts, tok/s including prefill.
#  one-core-per-rank/: greedy and temperature 0.8; trtssd ar, sd, ssd and auto (ssd under load
#    control; at temperature 0.8 the harness seeds every request, and a seeded request keeps its
#    batch speculating, so auto is ssd there) with the default lending (plain rounds borrow the
#    draft's core, rows kept exact), llama.cpp on 1 thread and llama.cpp's sd on 1 + 1 (the cores
#    trtssd's two ranks have);
#  two-threads/: greedy; trtssd ar with --lend-draft-cores always (llama.cpp's own two-thread decoding)
#    next to llama.cpp on 2 threads and transformers' greedy and assisted generation on 2 threads
#    (the GGUFs dequantized to fp32 by transformers' own loader).
# Writes one folder per engine and layout beside itself; run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/ggml-vs-llamacpp-batch1
.venv/bin/trtssd build --backend ggml >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
common=(--datasets humaneval,chat,math --batch 1 --no-calibrate --no-plots)
bench() { .venv/bin/trtssd bench "${common[@]}" "$@"; }
default=(--engine engines/smollm2-135m-ggml --prompts 4 --max-tokens 96 --k 7)
qwen=(--engine engines/qwen2.5-coder-1.5b-ggml --prompts 2 --max-tokens 64 --k 3)
bench "${default[@]}" --temperature 0,0.8 --systems ar,sd,ssd,auto,llama.cpp --llamacpp-threads 1 --out "$here/default-engine/one-core-per-rank"
bench "${default[@]}" --temperature 0 --systems ar,llama.cpp,hf-greedy,hf-assisted --lend-draft-cores always --llamacpp-threads 2 --peer-threads 2 --out "$here/default-engine/two-threads"
bench "${qwen[@]}" --temperature 0,0.8 --systems ar,sd,ssd,auto,llama.cpp,llama.cpp-sd --llamacpp-threads 1 --out "$here/qwen2.5-coder-1.5b/one-core-per-rank"
bench "${qwen[@]}" --temperature 0 --systems ar,llama.cpp,hf-greedy,hf-assisted --lend-draft-cores always --llamacpp-threads 2 --peer-threads 2 --out "$here/qwen2.5-coder-1.5b/two-threads"
