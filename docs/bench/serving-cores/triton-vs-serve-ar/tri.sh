#!/usr/bin/env bash
# serve ar vs Triton ar at c=8, alternating twice (the working tree's code).
cd /work/main
OUT=/tmp/p2/tri; rm -rf $OUT; mkdir -p $OUT
for rep in 1 2; do
  .venv/bin/trtssd serve --mode ar --port 18450 > $OUT/serve-$rep.log 2>&1 &
  pid=$!
  until curl -sf localhost:18450/health >/dev/null; do sleep 1; done
  .venv/bin/trtssd bench serve --num-prompts 16 --max-tokens 64 --ignore-eos --label serve-ar-$rep --out $OUT/serve-ar-$rep --base-url http://127.0.0.1:18450 --concurrency 8 2>&1 | grep "output tok/s" | cut -c1-150
  kill -INT $pid; wait $pid
  repo=$(mktemp -d)
  .venv/bin/trtssd triton-repo --out "$repo" --mode ar >/dev/null
  .venv/bin/trtssd triton-serve "$repo" --http-port 18452 --grpc-port 18453 --metrics-port 18454 > $OUT/triton-$rep.log 2>&1 &
  pid=$!
  until curl -sf localhost:18452/v2/models/trtssd/ready >/dev/null; do sleep 1; done
  .venv/bin/trtssd bench serve --num-prompts 16 --max-tokens 64 --ignore-eos --label triton-ar-$rep --out $OUT/triton-ar-$rep --backend triton --base-url http://127.0.0.1:18452 --metrics-url http://127.0.0.1:18454/metrics --concurrency 8 2>&1 | grep "output tok/s" | cut -c1-150
  kill -INT $pid; wait $pid
  rm -rf "$repo"
done
