#!/usr/bin/env bash
# Chunked prefill under a burst of arrivals: `trtssd serve` on the default ggml engine in its
# defaults (prefix cache on, chunks of 256 prompt tokens), 16 streamed requests x 64 tokens at
# concurrency 4, 8 and 16 (at 16 every request arrives at once), an old commit and the current
# tree alternated old, new, new, old. The old commit is the one before a step that emitted first
# tokens owed the running streams a round: there, prompts completing step after step held every
# stream until the last of them was in.
#   bash docs/bench/chunked-prefill-burst/run.sh [OLD_COMMIT]    # about 8 minutes
# (default 0267329). Writes before-1, after-1, after-2, before-2 and compare.md into
# round-between-prefills/ beside itself, through docs/bench/serve-text-off-target-cores/run.sh;
# run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
CONCURRENCY=${CONCURRENCY:-4,8,16} exec bash docs/bench/serve-text-off-target-cores/run.sh "${1:-0267329}" \
  docs/bench/chunked-prefill-burst/round-between-prefills --prefill-chunk 256
