#!/usr/bin/env bash
# A decode step on the default ggml engine next to llama-server's, at 1, 2 and 4 rows, on both
# cores: trtssd's executor forward and its plain-decoding step split into llama_decode and the
# Python around it (step_cost.py, in one process), then llama-server (as users start it, with
# --no-repack as in ../serve-vs-llama-server/run.sh) generating 128 tokens for 1, 2 and 4
# concurrent /completion requests, its own per-token timing. Quiet machine only; writes results.md.
#   bash docs/bench/ggml-step-next-to-llama-server/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/ggml-step-next-to-llama-server
engine=engines/smollm2-135m-ggml
llama_server=$(ls -d "$HOME"/.cache/trtssd/llama.cpp/*/bin/llama-server | head -1)
PORT=18471
rounds=${ROUNDS:-2}
out=$here/results.md
{
  echo "# A decode step next to llama-server's (default ggml engine, 2 threads)"
  echo
  echo "- machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "- code: $(git rev-parse --short HEAD); llama-server: $llama_server"
  echo "- $rounds rounds, each trtssd then llama-server (this machine drifts by 10-30% within minutes)"
} > $out
pid=""
stop() { if [[ -n "$pid" ]]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
ask() {
  curl -s "http://127.0.0.1:$PORT/completion" -d "{\"prompt\":\"Write a story about animal number $1.\",\"n_predict\":128,\"ignore_eos\":true,\"temperature\":0,\"cache_prompt\":false}" |
    python3 -c "import json, sys; print(round(1000 / json.load(sys.stdin)['timings']['predicted_per_second'], 1))" > "$2"
}
for round in $(seq "$rounds"); do
  {
    echo
    echo "## Round $round"
    echo
    echo "trtssd, in one process (\`step_cost.py\`): the executor's forward of one new token per row"
    echo "(median), and a plain-decoding step of \`LLM(mode=\"ar\")\` (128 tokens per request) split"
    echo "into llama_decode and the rest of the step (means), in milliseconds:"
    echo
    echo "| rows | executor forward | step: llama_decode | step: the rest |"
    echo "|---:|---:|---:|---:|"
    .venv/bin/python $here/step_cost.py $engine 2>/dev/null
  } >> $out
  "$llama_server" -m $engine/target/model.gguf -t 2 --no-repack --port $PORT >/dev/null 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 $pid; sleep 0.5; done
  ask 0 /dev/null  # warm-up
  {
    echo
    echo "llama-server (\`-m FILE -t 2 --no-repack\`), 128 tokens per request, its own timing"
    echo "(milliseconds per generated token, of each concurrent request):"
    echo
    echo "| concurrent requests | ms per token |"
    echo "|---:|---|"
  } >> $out
  tmp=$(mktemp -d)
  for n in 1 2 4; do
    asks=()
    for i in $(seq $n); do ask "$i" "$tmp/$n-$i" & asks+=($!); done
    wait "${asks[@]}"
    echo "| $n | $(cat "$tmp"/$n-* | paste -sd/) |" >> $out
  done
  rm -rf "$tmp"
  stop
done
echo >> $out
echo "- load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" >> $out
cat $out
