#!/usr/bin/env bash
# The test command: sets up .venv, then runs the whole suite on CPU (GPU tests skip themselves).
#   bash scripts/test.sh           everything (what .ci/run calls)
#   bash scripts/test.sh --fast    the fast tier: tests that start no process and download nothing
#                                  (tests/fast_tier.py), for the edit-test loop
# Any other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
