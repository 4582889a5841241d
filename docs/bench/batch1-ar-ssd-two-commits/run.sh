#!/usr/bin/env bash
# Batch-1 decode speed of two commits, alternated in one run (ar and ssd, both ggml engines):
#   bash docs/bench/batch1-ar-ssd-two-commits/run.sh OLD_REV NEW_REV [ROUNDS] [MAX_TOKENS]
# Each commit runs from a worktree of its own with this checkout's .venv and engines.
# Quiet machine only; writes results.jsonl and results.md here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/batch1-ar-ssd-two-commits
old=$1 new=$2 rounds=${3:-3} max_tokens=${4:-96}
work=$(mktemp -d)
trap 'git worktree remove --force "$work/old" 2>/dev/null; git worktree remove --force "$work/new" 2>/dev/null; rm -rf "$work"' EXIT
for side in old new; do
  git worktree add --detach -q "$work/$side" "${!side}"
done
rm -f $here/results.jsonl
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)" | tee $here/load.txt
for round in $(seq "$rounds"); do
  for engine in smollm2-135m-ggml qwen2.5-coder-1.5b-ggml; do
    for mode in ar ssd; do
      for side in old new; do
        line=$(PYTHONPATH="$work/$side" .venv/bin/python $here/run.py "$PWD/engines/$engine" $mode "$max_tokens" 2>/dev/null | tail -1)
        echo "{\"round\": $round, \"side\": \"$side\", \"rev\": \"$(git rev-parse --short "${!side}")\", ${line#\{}" | tee -a $here/results.jsonl
      done
    done
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $here/load.txt
.venv/bin/python - "$here" <<'PY'
import json, statistics, sys
from collections import defaultdict
here = sys.argv[1]
rows = [json.loads(l) for l in open(f"{here}/results.jsonl")]
cells = defaultdict(list)
for r in rows:
    cells[(r["engine"].rsplit("/", 1)[-1], r["mode"], r["side"], r["rev"])].append(r["decode_tok_s"])
lines = ["| engine | mode | commit | decode tok/s per round | mean |", "|---|---|---|---|---:|"]
for (engine, mode, side, rev), v in sorted(cells.items()):
    lines.append(f"| {engine} | {mode} | {side} {rev} | {', '.join(f'{x:.1f}' for x in v)} | {statistics.mean(v):.1f} |")
open(f"{here}/results.md", "w").write("\n".join(lines) + "\n\n" + open(f"{here}/load.txt").read())
print("\n".join(lines))
PY
