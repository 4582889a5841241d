cd /work/main
# A/B: the draft on aten's int4 kernel (e330b1b checked out at /tmp/ab_old) against our int4 matmul (working tree), offline sd batch 1.
mkdir -p docs/bench/int4-matmul/sd
for rep in 1 2; do
for tree in old new; do
  if [[ $tree == old ]]; then export PYTHONPATH=/tmp/ab_old TORCH_EXTENSIONS_DIR=/tmp/ab_old_ext; else unset PYTHONPATH TORCH_EXTENSIONS_DIR; fi
  .venv/bin/python -m trtssd.cli bench --systems sd --k 5 --datasets humaneval,chat --prompts 3 --max-tokens 128 --batch 1 --temperature 0 --no-calibrate --out docs/bench/int4-matmul/sd/$tree-$rep > docs/bench/int4-matmul/sd/$tree-$rep.log 2>&1
  echo "$tree-$rep rc=$? load=$(cut -d' ' -f1-3 /proc/loadavg)"
done; done
