#!/usr/bin/env bash
# GPU check: one prepared run of at most 8 minutes on one GPU, nothing fetched from the network.
#   env          versions, GPU, whether MPI can launch the draft rank                (15 s)
#   pytest -m gpu  kernel vs reference, CUDA IPC round trip between two processes,
#                executor on CUDA vs CPU logits, both ranks on the GPU (tiny models) (140 s)
#   speculative  ar / sd / ssd with target and draft on the GPU: greedy equality,
#                tokens/s, acceptance, cache hit rate, transport                     (150 s)
#   kernel, sweep, aot, executor  tree-attention and executor timings (1B/8B shapes) (50+20+20+45 s)
#   tensor parallel  a 2-way target on cuda:0 + cuda:1 (NCCL), greedy ar/ssd against T = 1;
#                only with two or more GPUs, else skipped and saying why (0 s)      (120 s)
# Each section is its own process under its own `timeout`, adding to one JSON file, so a failure
# or a hang loses only that section (scripts/gpu_check.py says how). Limits sum to 470 s on one GPU,
# 590 s on two or more.
# Output: $OUT/gpu_check.json and $OUT/gpu_pytest.log when OUT is set, else results/.
# Needs the machine's python3 with torch and triton (set PYTHON to choose another); the repo is put
# on PYTHONPATH instead of being installed. Python packages the GPU image lacks (gguf) travel as
# wheels in .whl/ (see docs/gpu.md) and are unpacked to a temporary directory, never installed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-results}
JSON="$OUT_DIR/gpu_check.json"
mkdir -p "$OUT_DIR"
rm -f "$JSON"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}  # silences Triton 3.9's default warning
unset TRITON_INTERPRET  # the GPU check runs compiled kernels

if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$SITE"
fi

failed=()
section() {  # section NAME LIMIT_S [extra args]
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s)"
  timeout -k 5 "$limit" "$PY" scripts/gpu_check.py --section "$name" --limit-s "$limit" \
    --budget-s $((limit * 3 / 4)) --out "$JSON" "$@" || failed+=("$name")
}

section env 15

echo "== pytest -m gpu (limit 140 s)"
timeout -k 5 140 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider --continue-on-collection-errors tests \
  --deselect tests/test_tensor_parallel_ranks.py::test_two_gpu_target_ranks_decode_as_one 2>&1 \
  | tee "$OUT_DIR/gpu_pytest.log"
pytest_rc=${PIPESTATUS[0]}
[ "$pytest_rc" -eq 0 ] || failed+=("pytest")
section pytest 10 --pytest-rc "$pytest_rc" --pytest-log "$OUT_DIR/gpu_pytest.log"

section speculative 150
section kernel 50
section sweep 20
section aot 20
section executor 45
section summary 10 --expect env,pytest,speculative,kernel,sweep,aot,executor

# A tensor-parallel target (T = 2): rank r on cuda:r, NCCL between the ranks, the draft on cuda:0
# in-process (launch "local": no MPI needed); its tokens against T = 1 (tests/test_tensor_parallel_ranks.py).
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)
if [ "${gpus:-0}" -ge 2 ]; then
  echo "== tensor parallel T=2 (limit 120 s)"
  timeout -k 5 120 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/test_tensor_parallel_ranks.py::test_two_gpu_target_ranks_decode_as_one 2>&1 \
    | tee "$OUT_DIR/gpu_tensor_parallel.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("tensor-parallel")
else
  echo "== tensor parallel T=2: skipped: ${gpus:-0} CUDA device(s) here, a 2-way target needs two (rank r on cuda:r)" \
    | tee "$OUT_DIR/gpu_tensor_parallel.log"
fi

echo "== done: JSON in $JSON; failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
