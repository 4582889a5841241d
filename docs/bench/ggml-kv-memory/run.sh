#!/usr/bin/env bash
# Resident memory of the target and draft ranks on both ggml engines, before and after llama.cpp's
# caches were sized for the running batch (kept prompts wait in host memory, so the caches need no
# sequences for them; the target's keeps room for trash of half its sequences' cells). Before is
# OLD_COMMIT (default fc31ee9: sequences for max_batch + prefix_cache_seqs), after the current
# tree; both at their defaults (max_batch 8, max_seq_len 2048, prefix_cache_seqs 8). Writes
# results.jsonl beside itself (about 1 minute).
#   bash docs/bench/ggml-kv-memory/run.sh [OLD_COMMIT]
set -euo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
here=docs/bench/ggml-kv-memory
worktree=$(mktemp -d /tmp/trtssd-before.XXXXXX)
cleanup() { git worktree remove --force "$worktree" 2>/dev/null || true; git worktree prune; }
trap cleanup EXIT
git worktree add --detach "$worktree" "${1:-fc31ee9}" >/dev/null
.venv/bin/trtssd build --backend ggml >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
probe=$root/$here/memory.py
: >"$here/results.jsonl"
for engine in engines/smollm2-135m-ggml engines/qwen2.5-coder-1.5b-ggml; do
  (cd "$worktree" && PYTHONPATH=$worktree "$root/.venv/bin/python" "$probe" "$root/$engine" --label before) \
    >>"$here/results.jsonl"
  PYTHONPATH=$root .venv/bin/python "$probe" "$root/$engine" --label after >>"$here/results.jsonl"
done
cat "$here/results.jsonl"
