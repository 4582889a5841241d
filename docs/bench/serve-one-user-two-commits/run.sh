#!/usr/bin/env bash
# One user on `trtssd serve` at two commits, alternated in one run: the default engine, the default
# mode and `--mode ar`, each server settled 15 s, then 16 chat requests x 64 tokens at concurrency 1,
# twice (`trtssd bench serve`, greedy, EOS ignored). Each commit runs from a worktree of its own with
# this checkout's .venv and engines. Quiet machine only; writes one folder per run and results.md here.
#   bash docs/bench/serve-one-user-two-commits/run.sh OLD_REV NEW_REV [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/serve-one-user-two-commits
old=$1 new=$2 rounds=${3:-2}
PORT=18463
work=$(mktemp -d)
pid=""
cleanup() {
  if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  git worktree remove --force "$work/old" 2>/dev/null; git worktree remove --force "$work/new" 2>/dev/null; rm -rf "$work"
}
trap cleanup EXIT
for side in old new; do
  git worktree add --detach -q "$work/$side" "${!side}"
done
rm -rf "$here"/runs && mkdir -p "$here"/runs
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)" > "$here"/load.txt
for round in $(seq "$rounds"); do
  for mode in default ar; do
    for side in old new; do
      label=$side-$(git rev-parse --short "${!side}")-$mode-$round
      args=(); [[ $mode == ar ]] && args=(--mode ar)
      (cd "$work/$side" && PYTHONPATH="$work/$side" "$OLDPWD/.venv/bin/python" -m trtssd.cli serve --port $PORT \
        --max-batch 16 --engine "$OLDPWD/engines/smollm2-135m-ggml" "${args[@]}") >"$here/runs/$label.log" 2>&1 &
      pid=$!
      until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
      sleep 15
      .venv/bin/trtssd bench serve --ignore-eos --label "$label" --out "$here/runs/$label" --no-plots \
        --base-url "http://127.0.0.1:$PORT" --concurrency 1,1 --datasets chat --endpoint /v1/chat/completions \
        --num-prompts 16 --max-tokens 64
      kill -INT "$pid"; wait "$pid" 2>/dev/null || true; pid=""
    done
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$here"/load.txt
.venv/bin/python - "$here" <<'PY'
import re, sys
from pathlib import Path
here = Path(sys.argv[1])
lines = ["| commit | mode | output tok/s (c=1, each run) | TTFT p50 ms |", "|---|---|---|---|"]
cells = {}
for md in sorted((here / "runs").glob("*/results.md")):
    side, rev, mode, _ = md.parent.name.split("-")
    rows = re.findall(r"^\| c=1 \| \d+ \| \d+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", md.read_text(), re.M)
    ttft = re.findall(r"^\| c=1 \| \d+\.\d+ \| (\d+\.\d+) \|", md.read_text(), re.M)
    cell = cells.setdefault((side, rev, mode), ([], []))
    cell[0].extend(rows); cell[1].extend(ttft)
for (side, rev, mode), (tok, ttft) in sorted(cells.items(), key=lambda kv: (kv[0][0] != "old", kv[0][2])):
    lines.append(f"| {side} {rev} | {mode} | {' / '.join(tok)} | {' / '.join(ttft)} |")
(here / "results.md").write_text("\n".join(lines) + "\n\n" + (here / "load.txt").read_text())
print("\n".join(lines))
PY
