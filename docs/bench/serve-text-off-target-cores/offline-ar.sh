#!/usr/bin/env bash
# Plain decoding without the server, old commit and current tree alternated process by process
# (offline_ar.py: batch 2, mode ar, four timings per process), to tell a cost of the target loop
# from one of serving. The current tree runs with the prefix cache and chunked prefill off, as
# run.sh's default. Writes RESULTS/results.jsonl beside itself; run on a quiet machine.
#   bash docs/bench/serve-text-off-target-cores/offline-ar.sh [OLD_COMMIT [RESULTS [PAIRS]]]
# (default: af005ee, offline-ar, 3 pairs; about 3 minutes).
set -euo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
old=${1:-af005ee}
here=docs/bench/serve-text-off-target-cores/${2:-offline-ar}
pairs=${3:-3}
mkdir -p "$here"
worktree=$(mktemp -d /tmp/trtssd-before.XXXXXX)
cleanup() { git worktree remove --force "$worktree" 2>/dev/null || true; git worktree prune; }
trap cleanup EXIT
git worktree add --detach "$worktree" "$old" >/dev/null
.venv/bin/trtssd build --backend ggml >/dev/null
engine=$root/engines/smollm2-135m-ggml
probe=$root/docs/bench/serve-text-off-target-cores/offline_ar.py
: >"$here/results.jsonl"
for pair in $(seq "$pairs"); do
  (cd "$worktree" && PYTHONPATH=$worktree "$root/.venv/bin/python" "$probe" "$engine" --label "before-$pair") \
    >>"$here/results.jsonl"
  PYTHONPATH=$root .venv/bin/python "$probe" "$engine" --label "after-$pair" --without-new-features \
    >>"$here/results.jsonl"
done
cat "$here/results.jsonl"
