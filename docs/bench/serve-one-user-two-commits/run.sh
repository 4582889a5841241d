#!/usr/bin/env bash
# One user on `trtssd serve` at two commits, alternated in one run: the default mode and `--mode ar`,
# each measured twice per server at concurrency 1 (docs/bench/serve-commits-alternated/run.sh does
# the steps). Quiet machine only; writes runs/ and results.md here.
#   bash docs/bench/serve-one-user-two-commits/run.sh OLD_REV NEW_REV [ROUNDS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=$here MODES="default ar" CONCURRENCY=1,1 ROUNDS=${3:-2} bash "$here/../serve-commits-alternated/run.sh" "$1" "$2"
