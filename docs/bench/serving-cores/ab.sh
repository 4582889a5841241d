#!/usr/bin/env bash
# A/B: serve ssd from HEAD (old) and the working tree (new), alternating; c=1 and c=8.
cd /work/main
OUT=/tmp/p2/ab; rm -rf $OUT; mkdir -p $OUT
for rep in 1 2; do
  for variant in old new; do
    if [[ $variant == old ]]; then PP=/tmp/wt-old; else PP=/work/main; fi
    PYTHONPATH=$PP .venv/bin/python -c "import sys; from trtssd.cli import main; sys.exit(main())" serve --mode ssd --port 18440 > $OUT/$variant-$rep.log 2>&1 &
    pid=$!
    until curl -sf localhost:18440/health >/dev/null; do sleep 1; done
    .venv/bin/trtssd bench serve --num-prompts 16 --max-tokens 64 --ignore-eos --label $variant-$rep --out $OUT/$variant-$rep --base-url http://127.0.0.1:18440 --concurrency 1,8 > $OUT/bench-$variant-$rep.log 2>&1
    kill -INT $pid; wait $pid
    grep "output tok/s" $OUT/bench-$variant-$rep.log | sed "s/^/$variant-$rep /" | cut -c1-160
  done
done
