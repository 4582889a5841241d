"""Resident memory of both ranks of an `LLM` in mode ssd, after one short request: one JSON line.

    python memory.py ENGINE_DIR --label LABEL

Run by run.sh under the tree being measured (PYTHONPATH); reads the draft rank among this
process's descendants.
"""

import argparse
import json
import logging
from pathlib import Path

import psutil

from trtssd import LLM, SamplingParams

logging.basicConfig(level=logging.WARNING)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engine")
    parser.add_argument("--label", required=True)
    args = parser.parse_args()
    with LLM(engine=args.engine, mode="ssd") as llm:
        llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=8))
        ranks = [p for p in psutil.Process().children(recursive=True)
                 if p.name().startswith("python") and "trtssd.runtime.draft_rank" in p.cmdline()]
        runtime = llm.runtime
        print(json.dumps({
            "label": args.label, "engine": Path(args.engine).name, "max_batch": runtime.max_batch,
            "max_seq_len": runtime.max_seq_len, "prefix_cache_seqs": runtime.prefix_cache_seqs,
            "target_rss_mib": round(psutil.Process().memory_info().rss / 2**20),
            "draft_rss_mib": round(ranks[0].memory_info().rss / 2**20)}))


if __name__ == "__main__":
    main()
