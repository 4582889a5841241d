"""One measurement of batch-1 decoding speed for the trtssd on PYTHONPATH: an engine, a mode,
greedy, a few prompts one at a time; prints one JSON line (tokens/s over the prompts' decode)."""

import json
import sys
import time

from trtssd import LLM, SamplingParams

PROMPTS = [
    "def quicksort(items):",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map handles collisions, with an example in Python.",
]


def main(engine: str, mode: str, max_tokens: int) -> None:
    options = {"mode": mode}
    if mode != "ar":
        options["plain_under_load"] = False  # measure the speculative path itself
    with LLM(engine, **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        tokens, seconds = 0, 0.0
        for prompt in PROMPTS:
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            seconds += time.perf_counter() - start - (out.ttft_s or 0.0)
            tokens += len(out.token_ids) - 1
    print(json.dumps({"engine": engine, "mode": mode, "tokens": tokens, "decode_tok_s": tokens / seconds}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
