#!/usr/bin/env bash
# GPU check, one command, under 8 minutes, nothing fetched from the network:
#   1. pytest -m gpu (kernel vs reference, CUDA paths of other components, TensorRT plugin if
#      tensorrt is installed), log kept;
#   2. scripts/gpu_check.py: tree-attention kernel vs torch SDPA vs the HBM bound, a launch-config
#      sweep, the TensorRT AOT kernel's PTX, executor decode/verify/tree steps on random-weight
#      1B- and 8B-shaped Llama models.
# Output: a summary on stdout; JSON in $OUT/gpu_check.json when OUT is set, else
# results/gpu_check.json (the pytest log beside it).
# Uses the machine's python3 with its own torch/triton (set PYTHON to choose another); the repo is
# put on PYTHONPATH instead of being installed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-results}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}  # silences Triton 3.9's default warning
unset TRITON_INTERPRET  # the GPU check runs compiled kernels

echo "== pytest -m gpu"
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests 2>&1 | tee "$OUT_DIR/gpu_pytest.log"
pytest_rc=${PIPESTATUS[0]}

echo "== timings"
timeout 290 "$PY" scripts/gpu_check.py --budget-s 220 --pytest-rc "$pytest_rc" \
  --pytest-log "$OUT_DIR/gpu_pytest.log" --out "$OUT_DIR/gpu_check.json"
check_rc=$?

echo "== done: pytest rc=$pytest_rc, gpu_check.py rc=$check_rc, JSON in $OUT_DIR/gpu_check.json"
[ "$pytest_rc" -eq 0 ] && [ "$check_rc" -eq 0 ]
