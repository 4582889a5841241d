#!/usr/bin/env bash
# Serving before and after text work (detokenization, stop strings, stream deltas) moved off the
# target's cores into the output processor: `trtssd serve` on the default ggml engine in its
# default mode, at concurrency 1, 2, 4, 8 and 16 (greedy, --ignore-eos, 16 prompts x 64 tokens),
# the old commit and the current tree alternated (old, new, new, old) in one run so that drift of
# the machine falls on both. Each server gets 30 s after it answers /health before it is measured.
#   bash docs/bench/serve-text-off-target-cores/run.sh [OLD_COMMIT [RESULTS [SERVE_OPTION...]]]
# (default: af005ee, text-move-only, --prefix-cache-seqs 0 --prefill-chunk 0). The old commit
# runs from a git worktree with this checkout's virtualenv; the current tree runs with the serve
# options given. By default they turn off what the old commit lacks: the prefix cache (it finds
# the chat template's prefix again, docs/bench/prefix-cache-decode-cost/) and chunked prefill (it
# trades inter-token latency for time to first token), so only the move of the text work
# differs. Writes before-1, after-1, after-2, before-2 and compare.md into RESULTS (a bare name:
# beside itself; a path: from the repository's root);
# run on a quiet machine. Environment: CONCURRENCY (default 1,2,4,8,16) and BLOCKS (default 1):
# BLOCKS=n runs the old-new-new-old block n times (before-1, after-1, after-2, before-2,
# before-3, after-3, ...), for levels whose run-to-run spread is wider than the difference;
# SERVE_OPTIONS (default none): serve options both trees get (e.g. --mode ar).
set -euo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
old=${1:-af005ee}
here=${2:-text-move-only}
[[ $here == */* ]] || here=docs/bench/serve-text-off-target-cores/$here  # a bare name: beside this script
after_options=("${@:3}")
[[ $# -ge 3 ]] || after_options=(--prefix-cache-seqs 0 --prefill-chunk 0)
mkdir -p "$here"
PORT=18452
worktree=$(mktemp -d /tmp/trtssd-before.XXXXXX)
pid=""
stop() { if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
cleanup() { stop; git worktree remove --force "$worktree" 2>/dev/null || true; git worktree prune; }
trap cleanup EXIT
git worktree add --detach "$worktree" "$old" >/dev/null
.venv/bin/trtssd build --backend ggml >/dev/null
engine=$root/engines/smollm2-135m-ggml
run() {  # label, source tree, extra serve options
  local label=$1 tree=$2
  shift 2
  (cd "$tree" && PYTHONPATH=$tree exec "$root/.venv/bin/python" -m trtssd.cli serve --port "$PORT" \
     --engine "$engine" --max-batch 16 "$@") >"$here/$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  sleep 30
  .venv/bin/trtssd bench serve --ignore-eos --label "$label" --out "$here/$label" \
    --base-url "http://127.0.0.1:$PORT" --concurrency "${CONCURRENCY:-1,2,4,8,16}" --num-prompts 16 --max-tokens 64
  stop
}
runs=()
for block in $(seq "${BLOCKS:-1}"); do
  first=$((2 * block - 1)) second=$((2 * block))
  run "before-$first" "$worktree" ${SERVE_OPTIONS:-}
  run "after-$first" "$root" ${SERVE_OPTIONS:-} "${after_options[@]}"
  run "after-$second" "$root" ${SERVE_OPTIONS:-} "${after_options[@]}"
  run "before-$second" "$worktree" ${SERVE_OPTIONS:-}
  runs+=("$here/before-$first" "$here/after-$first" "$here/after-$second" "$here/before-$second")
done
.venv/bin/trtssd bench serve --compare "${runs[@]}" --out "$here"
