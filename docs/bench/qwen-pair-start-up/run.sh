#!/usr/bin/env bash
# How long `trtssd generate` on the Qwen2.5-Coder pair takes to its first token, from a cold
# process: load both ranks, calibrate the draft's forwards (or read the stored calibration),
# prefill, one token. Each engine runs twice: first with an empty calibration cache, then with the
# calibration the first run stored. Writes results.txt beside itself; run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/qwen-pair-start-up
out=$here/results.txt
.venv/bin/trtssd build qwen2.5-coder-1.5b >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
calibration=$(mktemp -d)
trap 'rm -rf "$calibration"' EXIT
{
  echo "# seconds from process start to exit, \`trtssd generate --mode ssd --max-tokens 1\`"
  echo "# machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "# commit: $(git rev-parse --short HEAD), $(date -u +%FT%TZ)"
  printf '%-32s %-18s %8s %s\n' engine calibration seconds "load average at start"
} >"$out"
for engine in engines/qwen2.5-coder-1.5b engines/qwen2.5-coder-1.5b-ggml; do
  for calib in empty stored; do
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    start=$(date +%s.%N)
    TRTSSD_CALIBRATION_CACHE=$calibration .venv/bin/trtssd generate --engine "$engine" --mode ssd \
      --max-tokens 1 --prompt "def is_prime(n: int) -> bool:" >/dev/null
    seconds=$(echo "$(date +%s.%N) - $start" | bc)
    printf '%-32s %-18s %8.1f %s\n' "$engine" "$calib" "$seconds" "$load" >>"$out"
  done
done
cat "$out"
