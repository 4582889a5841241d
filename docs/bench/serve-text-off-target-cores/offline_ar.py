"""One process's plain (ar) decoding speed through `LLM.generate`, no server: batch 2 on the
default ggml engine, two pairs of prompts x 128 tokens (EOS ignored), timed four times after a
warm-up. Prints one JSON line. Runs on whichever trtssd is first on PYTHONPATH (offline-ar.sh
points it at the old commit's worktree or at this checkout)."""

import argparse
import json
import logging
import os
import time

from trtssd.llm import LLM
from trtssd.sampling import SamplingParams

PROMPTS = ["Write a Python function that reverses a linked list.", "Explain how a hash map works.",
           "What is the capital of France and why is it famous?", "def quicksort(arr):"]

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("engine")
parser.add_argument("--label", required=True)
parser.add_argument("--without-new-features", action="store_true",
                    help="prefix cache and chunked prefill off (what the old commit lacks)")
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING)
options = {"prefix_cache_seqs": 0, "prefill_chunk": 0} if args.without_new_features else {}
with LLM(args.engine, mode="ar", max_batch=2, **options) as llm:
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    llm.generate(PROMPTS[:2], params)
    rates = []
    for _ in range(4):
        start, tokens = time.perf_counter(), 0
        for first in (0, 2):
            tokens += sum(len(o.token_ids) for o in llm.generate(PROMPTS[first:first + 2], params))
        rates.append(round(tokens / (time.perf_counter() - start), 1))
print(json.dumps({"label": args.label, "tokens_per_s": rates, "load_average": os.getloadavg()}))
