"""The fast backup speculator for cache misses (docs/algorithm.md §4).

It proposes by prompt lookup (the continuation of the most recent earlier match of the sequence's
last n-gram). Its tokens are deterministic, so verification treats them as a point mass and stays
exact at any temperature. The choice between it and the neural backup, per round, is
`prefer_neural`'s, from running estimates of what each costs and yields (`BackupCosts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from trtssd.spec_decode.speedup import decayed


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

# --- backup choice per round (docs/algorithm.md section 4) ---------------------------------------


@dataclass
class BackupCosts:
    """Running estimates of what each backup costs and yields, in seconds and tokens: exponential
    averages like `StepCostModel`'s scale, slower (0.9) because one observation per round is
    noisier than one per forward."""

    verify_s: float = 0.05  # target verify time per round
    prespec_s: float = 0.0  # draft pre-speculation per round (SSD): with verify, what a round lasts
    jit_s: float = 0.05  # draft time for a K-token just-in-time draft of the missing rows
    tokens_neural: float = 2.5  # tokens per round when the row's speculation came from the draft
    tokens_fast: float = 1.1  # tokens per round after a fast-backup proposal
    decay: float = 0.9

    def observe(self, name: str, value: float) -> None:
        setattr(self, name, decayed(getattr(self, name), value, self.decay))


def prefer_neural(batch: int, misses: int, tokens_hit: float, costs: BackupCosts) -> bool:
    """Neural backup iff it gives more tokens per second for this round.

    A neural miss delays the whole batch by the JIT draft; a fast miss delays nothing but yields
    fewer tokens. At batch 1 that usually favours neural, at large batch fast (paper §4). A round
    lasts as long as the longer of the target's verify and the draft's pre-speculation, which run
    side by side; the JIT draft comes on top of that.
    """
    if misses == 0:
        return False
    hit_tokens = (batch - misses) * tokens_hit
    round_s = max(costs.verify_s, costs.prespec_s)
    neural = (hit_tokens + misses * costs.tokens_neural) / (round_s + costs.jit_s)
    fast = (hit_tokens + misses * costs.tokens_fast) / round_s
    return neural > fast
