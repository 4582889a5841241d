"""Time one draft (and target) forward of n rows after a context, per engine, side by side.

What a draft's tree step costs at each width decides which kernel it should run (docs/draft.md:
int4 against int8). Thread-CPU ms, median of --repeats, one thread, after a 128-token context.

Usage:
    .venv/bin/python scripts/bench_draft_rows.py engines/smollm2-135m engines/smollm2-int8 \
        --out docs/bench/draft-int8/rows.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from trtssd.backends.base import chain_chunk
from trtssd.backends.loading import load_side
from trtssd.bench.report import machine_info, write_json
from trtssd.models.engine_dir import load_manifest

log = logging.getLogger("bench_draft_rows")

ROWS = (1, 2, 4, 6, 8, 12, 16, 24)
CONTEXT = 128


def forward_ms(executor, rows: int, repeats: int) -> float:
    """Median thread-CPU ms of a forward of ``rows`` chained tokens after the context."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        executor.forward([chain_chunk(0, list(range(100, 100 + rows)), CONTEXT)])
        times.append(time.thread_time() - start)
    return round(statistics.median(times) * 1e3, 2)


def time_side(engine: str, side: str, repeats: int) -> dict[int, float]:
    executor = load_side(engine, side, max_seqs=1, max_seq_len=512)
    executor.add_sequence(0)
    executor.forward([chain_chunk(0, list(range(1000, 1000 + CONTEXT)), 0, last_logits_only=True)])
    executor.commit(0, CONTEXT)
    return {n: forward_ms(executor, n, repeats) for n in ROWS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", nargs="+", help="engine directories")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--target", action="store_true", help="time each engine's target too")
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    results = []
    for engine in args.engines:
        draft = load_manifest(engine)["draft"]
        sides = ("draft", "target") if args.target else ("draft",)
        for side in sides:
            ms = time_side(engine, side, args.repeats)
            results.append({"engine": engine, "side": side, "draft_backend": draft["backend"], "ms": ms})
            log.info("%s %s: %s", engine, side, "  ".join(f"{n}:{v:.1f}" for n, v in ms.items()))
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),  # CPU, load average, versions, commit
        "context": CONTEXT, "unit": "thread-CPU ms per forward", "results": results,
    }
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
