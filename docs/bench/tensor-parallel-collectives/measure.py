"""The collectives of a tensor-parallel forward, timed on this machine: one all-reduce of the
[tokens, hidden] state and the head's all-gather of [tokens, ceil(V/T)] logits per rank, over
gloo between T processes on the loopback (what trtssd/models/tensor_parallel.py calls), for
forwards of 1..64 tokens. Writes collectives.json for `trtssd plan --collectives` and prints a
markdown table with the per-forward cost of a model with ``--layers`` decoder layers.

    python measure.py --size 2 --hidden 576 --vocab 49152 --layers 30 --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

log = logging.getLogger("collectives")

TOKENS = (1, 2, 4, 8, 16, 32, 64)


def _time(op, repeats: int) -> float:
    """Median seconds of ``op`` after a warm-up, each call ended by a barrier-free wait (gloo's
    collectives are synchronous), so every rank times the same exchange."""
    for _ in range(3):
        op()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, args: argparse.Namespace, store: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.size,
                            timeout=timedelta(seconds=60))
    local_vocab = -(-args.vocab // args.size)
    result = {"allreduce": {}, "allgather": {}}
    for n in TOKENS:
        state = torch.randn(n, args.hidden)
        logits = torch.randn(n, local_vocab)
        parts = [torch.empty_like(logits) for _ in range(args.size)]
        result["allreduce"][str(n)] = _time(lambda: dist.all_reduce(state), args.repeats)
        result["allgather"][str(n)] = _time(lambda: dist.all_gather(parts, logits), args.repeats)
    if rank == 0:
        out.update(result)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2, help="ranks T")
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (default: SmolLM2-135M's)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary (default: SmolLM2-135M's)")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers, for the per-forward table")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per size (median)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    store = (args.out / "store").resolve()  # file:// needs an absolute path
    store.unlink(missing_ok=True)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(args, str(store), out), nprocs=args.size, join=True)
        result = dict(out)
    store.unlink(missing_ok=True)
    record = {"name": f"gloo on {os.cpu_count()} CPU cores, {args.size} ranks, loopback", "size": args.size,
              "hidden": args.hidden, "vocab": args.vocab, "dtype": "float32", "repeats": args.repeats,
              "load_average": os.getloadavg(), **result}
    (args.out / "collectives.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"T = {args.size}, hidden {args.hidden}, vocab {args.vocab} (fp32), {args.layers} layers; "
             f"median of {args.repeats}; load average {record['load_average'][0]:.2f}", "",
             "| tokens | all-reduce us | all-gather us | per forward ms (2 x layers all-reduces + 1 all-gather) |",
             "|---:|---:|---:|---:|"]
    for n in TOKENS:
        ar, ag = result["allreduce"][str(n)], result["allgather"][str(n)]
        lines.append(f"| {n} | {ar * 1e6:.1f} | {ag * 1e6:.1f} | {(2 * args.layers * ar + ag) * 1e3:.2f} |")
    table = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(table)
    log.info("%s", table)


if __name__ == "__main__":
    main()
