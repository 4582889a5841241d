"""The fast backup speculator for cache misses (docs/algorithm.md §4).

It proposes by prompt lookup (the continuation of the most recent earlier match of the sequence's
last n-gram). Its tokens are deterministic, so verification treats them as a point mass and stays
exact at any temperature. The choice between it and the neural backup is the speedup model's
(`trtssd.runtime.speedup_model.prefer_neural`).
"""

from __future__ import annotations

from typing import Sequence


def ngram_proposal(history: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """K tokens continuing ``history`` by n-gram lookup; repeats the last token when nothing
    matches (any deterministic proposal is exact as a point mass, this one is just cheap)."""
    seq = list(history)
    out: list[int] = []
    for _ in range(k):
        out.append(_lookup_next(seq, max_ngram))
        seq.append(out[-1])
    return out


def _lookup_next(seq: list[int], max_ngram: int) -> int:
    n_tokens = len(seq)
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        suffix = seq[n_tokens - n :]
        # most recent earlier occurrence whose continuation exists
        for start in range(n_tokens - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n]
    return seq[-1] if seq else 0

