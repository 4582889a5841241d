"""What a decode step costs on the default ggml engine, in one process: the executor's forward of
1, 2 and 4 rows (each a sequence of ~100 cells, row-invariant, two threads, as `trtssd serve`
runs plain rounds on both cores), and a plain-decoding `LLM` step split into llama_decode and the
Python around it (sampling, each row's chunk, the outputs). Prints one markdown table row per
measurement.
    .venv/bin/python docs/bench/ggml-step-next-to-llama-server/step_cost.py ENGINE_DIR"""

from __future__ import annotations

import statistics
import sys
import time

from trtssd import LLM, SamplingParams
from trtssd.backends import ggml_backend
from trtssd.backends.base import chain_chunk
from trtssd.backends.ggml_backend import GgmlExecutor

ROWS = (1, 2, 4)
STEPS = 128


def _prompt(n: int, seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 40000 + 100 for i in range(n)]


def forward_ms(gguf: str) -> dict[int, float]:
    """Median ms of one forward of one new token for each of ``rows`` sequences."""
    out = {}
    for rows in ROWS:
        ex = GgmlExecutor(gguf, max_seqs=16, max_seq_len=1024, threads=2)
        for s in range(rows):
            ex.add_sequence(s)
            ex.forward([chain_chunk(s, _prompt(100, s), 0, last_logits_only=True)])
            ex.commit(s, 100)
        times = []
        for _ in range(40):
            t0 = time.perf_counter()
            ex.forward([chain_chunk(s, [5 + s], ex.committed(s)) for s in range(rows)])
            times.append(time.perf_counter() - t0)
            for s in range(rows):
                ex.commit(s, 1)
        ex.close()
        out[rows] = 1000 * statistics.median(times[5:])
    return out


def step_split_ms(engine: str) -> dict[int, tuple[float, float]]:
    """(ms in llama_decode, ms around it) per plain-decoding step of ``rows`` requests."""
    spent = [0.0]
    decode = ggml_backend.GgmlExecutor._decode

    def timed(self, entries):
        t0 = time.perf_counter()
        try:
            return decode(self, entries)
        finally:
            spent[0] += time.perf_counter() - t0

    ggml_backend.GgmlExecutor._decode = timed
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    out = {}
    with LLM(engine=engine, launch="local", mode="ar", max_batch=16, max_model_len=512) as llm:
        for rows in ROWS:
            prompts = [f"Write a story about animal number {i}." for i in range(rows)]
            llm.generate(prompts, params)
            spent[0] = 0.0
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            out[rows] = (1000 * spent[0] / STEPS, 1000 * (wall - spent[0]) / STEPS)
    ggml_backend.GgmlExecutor._decode = decode
    return out


def main() -> None:
    engine = sys.argv[1]
    gguf = f"{engine}/target/model.gguf"
    forwards = forward_ms(gguf)
    split = step_split_ms(engine)
    for rows in ROWS:
        print(f"| {rows} | {forwards[rows]:.1f} | {split[rows][0]:.1f} | {split[rows][1]:.2f} |")


if __name__ == "__main__":
    main()
