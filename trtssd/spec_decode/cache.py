"""The speculation cache: verification outcome -> the speculation pre-computed for it.

Key (seq_id, k, bonus): "k proposals accepted, then ``bonus`` emitted". Value: the K tokens the
draft's tree decode produced for that branch and the distributions they were sampled from
(needed for exact verification at temperature > 0; None for greedy/point-mass drafts). The
draft loop clears or evicts stale entries every round and repopulates after its tree decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Speculation:
    tokens: torch.Tensor  # [K] long
    probs: torch.Tensor | None  # [K, V] the q' rows the tokens were sampled from; None = point mass


@dataclass(frozen=True)
class LookupStats:
    hits: int
    misses: int


class SpeculationCache:
    """Entries for every live sequence; hit/miss counts live on the instance, not in globals."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int, int], Speculation] = {}
        self._keys_of_seq: dict[int, list[tuple[int, int, int]]] = {}
        self.hits = 0  # cumulative over lookups since construction / reset_stats
        self.misses = 0
        self.last_lookup = LookupStats(0, 0)  # counts of the most recent lookup call

    def __len__(self) -> int:
        return len(self._entries)

    def populate(
        self,
        seq_id: int,
        keys: Sequence[tuple[int, int]],
        tokens: torch.Tensor,
        probs: torch.Tensor | None,
    ) -> None:
        """Add N branches of one sequence: keys[i] = (k, bonus) -> tokens[i] [K], probs[i] [K, V].

        Entries are views into the given tensors (no copy). A key already present raises: the
        caller must clear() or evict() stale entries before repopulating.
        """
        n = len(keys)
        if tokens.dim() != 2 or tokens.shape[0] != n or tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be a long tensor [N={n}, K], got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if probs is not None and (probs.dim() != 3 or tuple(probs.shape[:2]) != tuple(tokens.shape)):
            raise ValueError(
                f"probs must be [N, K, V] with [N, K] = {tuple(tokens.shape)}, got {tuple(probs.shape)}"
            )
        full_keys = [(seq_id, int(k), int(bonus)) for k, bonus in keys]
        if len(set(full_keys)) != n:
            raise ValueError(f"duplicate (k, bonus) keys for sequence {seq_id}")
        clashes = [key for key in full_keys if key in self._entries]
        if clashes:
            raise ValueError(f"cache already holds {clashes[:3]}...; clear() or evict({seq_id}) first")
        for i, key in enumerate(full_keys):
            self._entries[key] = Speculation(tokens[i], None if probs is None else probs[i])
        self._keys_of_seq.setdefault(seq_id, []).extend(full_keys)

    def lookup(self, keys: Sequence[tuple[int, int, int]]) -> list[Speculation | None]:
        """Speculations for (seq_id, k, bonus) keys, None on a miss. Counts in ``last_lookup``."""
        found = [self._entries.get((int(s), int(k), int(b))) for s, k, b in keys]
        hits = sum(spec is not None for spec in found)
        self.last_lookup = LookupStats(hits=hits, misses=len(found) - hits)
        self.hits += hits
        self.misses += len(found) - hits
        return found

    def evict(self, seq_id: int) -> None:
        """Drop every entry of a sequence (finished, or before repopulating it). Idempotent."""
        for key in self._keys_of_seq.pop(seq_id, []):
            del self._entries[key]

    def clear(self) -> None:
        """Drop every entry (start of a round). Counters are kept."""
        self._entries.clear()
        self._keys_of_seq.clear()

    def reset_stats(self) -> None:
        self.hits = 0
        self.misses = 0
        self.last_lookup = LookupStats(0, 0)
