"""SSD on the Qwen pair's ggml target with two drafts of the same 0.5B model: its GGUF on llama.cpp
(the ggml engine's draft) and its int8 build on trtssd's compiled draft layers (the torch
engine's draft), K = 3, greedy, three chat prompts x 64 tokens, every round speculated.

    .venv/bin/python docs/bench/kernels-vs-ggml/ssd_with_int8_draft.py   # writes ssd_with_int8_draft.txt here

Needs both Qwen engines (`trtssd build qwen2.5-coder-1.5b` and `... --backend ggml`) and a quiet machine.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from trtssd import LLM, ModelRef, SamplingParams

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GGML, TORCH = ROOT / "engines" / "qwen2.5-coder-1.5b-ggml", ROOT / "engines" / "qwen2.5-coder-1.5b"
PROMPTS = ("Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a hash map is in two sentences.",
           "Solve: a train travels 120 km in 1.5 hours. What is its average speed?")
DRAFTS = {"ggml draft (GGUF on llama.cpp)": ModelRef(str(GGML), "draft"),
          "int8 draft (compiled draft layers)": ModelRef(str(TORCH), "draft")}


def run(label: str, draft: ModelRef) -> list[str]:
    lines = []
    with LLM(target=ModelRef(str(GGML), "target"), draft=draft, mode="ssd", k=3, plain_under_load=False) as llm:
        for prompt in PROMPTS:
            t0 = time.perf_counter()
            out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=64))
            rate = len(out.token_ids) / (time.perf_counter() - t0)
            lines.append(f"{label}: {rate:.1f} tok/s, acceptance length {out.metrics['mean_acceptance_length']:.2f}, "
                         f"cache hit rate {out.metrics['cache_hit_rate']:.2f}; {prompt[:40]}")
    return lines


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    lines = [f"load average at start {os.getloadavg()}"]
    for label, draft in DRAFTS.items():
        lines += run(label, draft)
    lines.append(f"load average at end {os.getloadavg()}")
    (HERE / "ssd_with_int8_draft.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
