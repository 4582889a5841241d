"""The speculation cache of one sequence: verification outcome -> the speculation made for it.

The draft pre-speculates once per round per sequence (docs/algorithm.md section 3), so the cache is
one entry set per sequence, replaced every round: key (k, bonus) = "k proposals accepted, then
``bonus`` emitted"; value = the K tokens the tree decode drew for that branch and the q' rows they
were drawn from (needed for exact verification at temperature > 0; None for greedy rows). The
tree's KV and logits stay with it, so the glue after a hit can reuse the branch instead of
decoding it again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtssd.spec_decode.tree import TreeLayout


@dataclass(frozen=True)
class CachedSpeculation:
    tokens: torch.Tensor  # [K] long
    probs: torch.Tensor | None  # [K, V] the q' rows the tokens were drawn from; None = greedy
    branch: int  # the tree branch that drew them


@dataclass(frozen=True)
class PreSpeculation:
    """One sequence's pre-speculation for its next round (the cache entries of that sequence)."""

    fanout: tuple[int, ...]  # F_j per depth j = 0..K used to fork
    layout: TreeLayout  # where the branches' KV lives in the draft's scratch region
    step_logits: tuple[torch.Tensor, ...]  # per tree step d: [branches, V] logits of token d+1
    entries: dict[tuple[int, int], CachedSpeculation]  # (k, bonus) -> speculation

    def lookup(self, num_accepted: int, bonus: int) -> CachedSpeculation | None:
        return self.entries.get((num_accepted, bonus))

    def forks_at(self, depth: int) -> int:
        """How many candidates were cached for "``depth`` accepted" (0 past the fan-out)."""
        return self.fanout[depth] if depth < len(self.fanout) else 0


def pre_speculation(fanout: tuple[int, ...], layout: TreeLayout, step_logits: tuple[torch.Tensor, ...],
                    tokens: torch.Tensor, probs: torch.Tensor | None) -> PreSpeculation:
    """The cache entries of one tree: branch i (fork (j, c) of ``layout``) -> tokens[i], probs[i]."""
    n = layout.num_branches
    if tokens.dim() != 2 or tokens.shape[0] != n or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be a long tensor [N={n}, K], got {tokens.dtype} {tuple(tokens.shape)}")
    if probs is not None and tuple(probs.shape[:2]) != tuple(tokens.shape):
        raise ValueError(f"probs must be [N, K, V] with [N, K] = {tuple(tokens.shape)}, got {tuple(probs.shape)}")
    keys = list(zip(layout.fork_depth.tolist(), layout.fork_token.tolist()))
    if len(set(keys)) != n:
        raise ValueError(f"duplicate (k, bonus) forks for sequence {layout.seq_id}: {keys}")
    entries = {key: CachedSpeculation(tokens[i], None if probs is None else probs[i], i) for i, key in enumerate(keys)}
    return PreSpeculation(tuple(fanout), layout, tuple(step_logits), entries)
