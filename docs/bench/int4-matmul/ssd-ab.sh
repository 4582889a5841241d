#!/usr/bin/env bash
# A/B: the draft on aten's int4 kernel (e330b1b, /tmp/ab_old) against our int4 matmul (working tree), offline ssd batch 1.
cd /work/main
run() {  # label, tree, k
  local label=$1 tree=$2 k=$3
  if [[ $tree == old ]]; then
    PYTHONPATH=/tmp/ab_old TORCH_EXTENSIONS_DIR=/tmp/ab_old_ext .venv/bin/python -m trtssd.cli bench --systems ssd --k $k --datasets humaneval,chat --prompts 3 --max-tokens 128 --batch 1 --temperature 0 --no-calibrate --out docs/bench/int4-matmul/ssd/$label > docs/bench/int4-matmul/ssd/$label.log 2>&1
  else
    .venv/bin/python -m trtssd.cli bench --systems ssd --k $k --datasets humaneval,chat --prompts 3 --max-tokens 128 --batch 1 --temperature 0 --no-calibrate --out docs/bench/int4-matmul/ssd/$label > docs/bench/int4-matmul/ssd/$label.log 2>&1
  fi
  echo "$label rc=$? load=$(cut -d' ' -f1-3 /proc/loadavg)"
}
mkdir -p docs/bench/int4-matmul/ssd
for rep in 1 2; do
  run old-k5-$rep old 5
  run new-k5-$rep new 5
  run new-k7-$rep new 7
done
