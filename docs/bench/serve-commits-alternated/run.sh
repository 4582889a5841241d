#!/usr/bin/env bash
# `trtssd serve` at several commits, alternated in one run: the default engine, each commit's server
# settled 15 s, then 16 chat requests x 64 tokens at each concurrency of CONCURRENCY (`trtssd bench
# serve`, greedy, EOS ignored); per round, every mode of MODES at every commit. Each commit runs from
# a worktree of its own with this checkout's .venv and engines. Quiet machine only; writes runs/ and
# results.md into OUT (default: beside this script).
#   MODES="ar default" CONCURRENCY=1,2,4 ROUNDS=2 [OUT=DIR] bash docs/bench/serve-commits-alternated/run.sh REV...
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-docs/bench/serve-commits-alternated}
modes=${MODES:-ar} concurrency=${CONCURRENCY:-1,2,4} rounds=${ROUNDS:-2}
PORT=18467
work=$(mktemp -d)
pid=""
revs=("$@")
cleanup() {
  if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  for i in "${!revs[@]}"; do git worktree remove --force "$work/$i" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
for i in "${!revs[@]}"; do git worktree add --detach -q "$work/$i" "${revs[$i]}"; done
rm -rf "$out"/runs && mkdir -p "$out"/runs
echo "modes $modes, concurrency $concurrency, $rounds rounds; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)" > "$out"/load.txt
for round in $(seq "$rounds"); do
  for mode in $modes; do
    for i in "${!revs[@]}"; do
      label=$i-$(git rev-parse --short "${revs[$i]}")-$mode-$round
      args=(); [[ $mode == ar ]] && args=(--mode ar)
      (cd "$work/$i" && PYTHONPATH="$work/$i" "$OLDPWD/.venv/bin/python" -m trtssd.cli serve --port $PORT \
        --max-batch 16 --engine "$OLDPWD/engines/smollm2-135m-ggml" "${args[@]}") >"$out/runs/$label.log" 2>&1 &
      pid=$!
      until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
      sleep 15
      .venv/bin/trtssd bench serve --ignore-eos --label "$label" --out "$out/runs/$label" --no-plots \
        --base-url "http://127.0.0.1:$PORT" --concurrency "$concurrency" --datasets chat \
        --endpoint /v1/chat/completions --num-prompts 16 --max-tokens 64
      kill -INT "$pid"; wait "$pid" 2>/dev/null || true; pid=""
    done
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out"/load.txt
.venv/bin/python - "$out" <<'PY'
import re, sys
from pathlib import Path
out = Path(sys.argv[1])
cells = {}
for md in sorted((out / "runs").glob("*/results.md")):
    order, rev, mode, _ = md.parent.name.split("-")
    by_c = cells.setdefault((int(order), rev, mode), {})
    text = md.read_text()
    for c, tok in re.findall(r"^\| c=(\d+) \| \d+ \| \d+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", text, re.M):
        by_c.setdefault(int(c), [[], []])[0].append(tok)
    for c, ttft in re.findall(r"^\| c=(\d+) \| \d+\.\d+ \| (\d+\.\d+) \|", text, re.M):
        by_c[int(c)][1].append(ttft)
conc = sorted({c for by_c in cells.values() for c in by_c})
lines = ["| commit | mode | " + " | ".join(f"c={c}: tok/s; TTFT p50 ms (each run)" for c in conc) + " |",
         "|---|---|" + "---|" * len(conc)]
for (order, rev, mode), by_c in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0])):
    lines.append(f"| {rev} | {mode} | " + " | ".join(f"{' / '.join(by_c[c][0])}; {' / '.join(by_c[c][1])}" for c in conc) + " |")
(out / "results.md").write_text("\n".join(lines) + "\n\n" + (out / "load.txt").read_text())
print("\n".join(lines))
PY
