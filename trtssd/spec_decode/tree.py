"""Where the draft's glue and tree tokens live: logical positions, storage slots and masks.

After the glue decode of [b, s_1..s_K] the draft's region (slots after its committed prefix N)
holds those K+1 tokens at region slots 0..K. Fork (j, c) continues after b, s_1..s_j, so its
tree tokens sit at logical positions N+j+1+d. Their KV goes to scratch slots after the glue,
laid out step-major: branch i at step d uses region slot K+1 + d*nb + i. A branch sees the
prefix, glue slots 0..j and its own earlier tree slots, never other branches
(docs/algorithm.md §3).

The first token's tree (made while the target prefills, before any speculation exists) has no
glue: its forks are guesses of the token after the prompt, at logical position N + d, and its
tree slots start right after the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtssd.backends.base import Chunk


@dataclass(frozen=True)
class TreeLayout:
    seq_id: int
    committed: int  # N: the draft's committed prefix length (glue starts at slot N)
    k: int  # lookahead; the glue holds k+1 tokens
    fork_depth: torch.Tensor  # [nb] long, j of each branch
    fork_token: torch.Tensor  # [nb] long, c of each branch
    glued: bool = True  # False: the first token's tree, continuing the prefix itself (no glue)

    @property
    def num_branches(self) -> int:
        return int(self.fork_depth.numel())

    @property
    def glue_len(self) -> int:
        return self.k + 1 if self.glued else 0

    def step_chunk(self, step: int, tokens: torch.Tensor) -> Chunk:
        """The forward input of tree step ``step`` (0 feeds the fork tokens themselves)."""
        nb, g = self.num_branches, self.glue_len
        branch = torch.arange(nb)
        region_slots = g + step * nb + branch
        width = g + (step + 1) * nb
        mask = torch.zeros(nb, width, dtype=torch.bool)
        mask[:, :g] = torch.arange(g).view(1, g) <= self.fork_depth.view(nb, 1)
        for d in range(step + 1):
            mask[branch, g + d * nb + branch] = True
        return Chunk(
            seq_id=self.seq_id,
            tokens=tokens.to(torch.long),
            positions=self.committed + step + (self.fork_depth + 1 if self.glued else torch.zeros_like(self.fork_depth)),
            slots=self.committed + region_slots,
            mask=mask,
        )


def append_chunk(seq_id: int, committed: int, tokens: list[int], chain_len: int) -> Chunk:
    """Tokens continuing a causal chain already written at region slots [0, chain_len)."""
    n = len(tokens)
    start = committed + chain_len
    idx = torch.arange(start, start + n)
    mask = torch.ones(n, chain_len + n, dtype=torch.bool)
    mask[:, chain_len:] = torch.ones(n, n, dtype=torch.bool).tril()
    return Chunk(seq_id, torch.tensor(tokens, dtype=torch.long), idx, idx, mask)
