"""Saguaro: the cache-aware draft distribution q' and fork selection (ALGORITHM.md sections 3, 6).

After a rejection at depth j the bonus is drawn from (p_j - q_j)+. The draft caches speculations
for its top-F_j guesses of that bonus. Sampling s_{j+1} from q'_j instead of q_j, where q'_j
scales q_j's top-(F_j + 1) probabilities by C <= 1, lowers q' on exactly those guesses, which
raises the residual mass there and so the cache hit rate. Verification stays exact because the
target verifies with the same q' rows the draft sampled from (trtssd.spec.verify).

Both functions rank tokens with the same stable descending sort, so the scaled set and the fork
candidates agree on ties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def _descending(q: torch.Tensor) -> torch.Tensor:
    """Token ids ordered by descending probability; ties keep the lower id first."""
    return torch.sort(q, dim=-1, descending=True, stable=True).indices


def saguaro_probs(q: torch.Tensor, fanout: torch.Tensor | int, c: float) -> torch.Tensor:
    """q' = normalize(q with its top-(F+1) probabilities multiplied by c).

    q:      [..., V] the draft's processed distribution (trtssd.sampling.processed_probs).
    fanout: F per row, an int or a long tensor broadcastable to q.shape[:-1]. For the draft's
            proposal at depth j (sampled after j speculated tokens) use F_j, the fan-out cached
            for "j accepted". F < 0 leaves that row unchanged.
    c:      scale in (0, 1]; 1 returns q unchanged.

    The draft samples from this and ships the rows; the target verifies with the shipped rows.
    Recomputing it from the same q gives bit-identical rows (tests check this).
    """
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0 < c <= 1:
        raise ValueError(f"Saguaro scale c must be a number in (0, 1], got {c!r}")
    if c == 1:
        return q
    vocab = q.shape[-1]
    fanout = torch.as_tensor(fanout, dtype=torch.long, device=q.device)
    fanout = torch.broadcast_to(fanout, q.shape[:-1])
    q = q.float()
    ranks = torch.empty_like(q, dtype=torch.long).scatter_(
        -1, _descending(q), torch.arange(vocab, device=q.device).expand_as(q).contiguous()
    )
    scaled = ranks < (fanout[..., None] + 1)  # F < 0 -> nothing scaled
    weighted = torch.where(scaled, q * c, q)
    return weighted / weighted.sum(dim=-1, keepdim=True)


@dataclass(frozen=True)
class Forks:
    """Fork candidates of a batch of sequences, one entry per (sequence, depth, token)."""

    seq_index: torch.Tensor  # [M] long, row of the batch
    depth: torch.Tensor  # [M] long, accepted count j the fork stands for
    token: torch.Tensor  # [M] long, the guessed bonus token


def select_forks_batched(
    glue_probs: torch.Tensor, proposals: torch.Tensor, fanout: torch.Tensor | Sequence[int]
) -> Forks:
    """Fork candidates for N sequences.

    glue_probs: [N, K+1, V] the draft's processed distribution q (not q') from the glue decode;
                row j is the distribution of the bonus if exactly j proposals are accepted.
    proposals:  [N, K] the speculation the glue decode ran over.
    fanout:     [K+1] or [N, K+1] ints >= 0.

    At depth j < K the candidates are the top-F_j tokens of row j excluding proposals[:, j]:
    being the bonus at depth j means proposal j was rejected, and rejecting x implies
    p(x) < q'(x), so the residual (p - q')+ is 0 at x (under point mass or greedy it is removed
    outright); x can never be that bonus, so a slot on it would be wasted. At depth K (all
    accepted) the bonus is drawn from p_K and nothing is excluded.
    """
    if glue_probs.dim() != 3:
        raise ValueError(f"glue_probs must be [N, K+1, V], got {tuple(glue_probs.shape)}")
    n, k_plus_1, vocab = glue_probs.shape
    k_max = k_plus_1 - 1
    if tuple(proposals.shape) != (n, k_max):
        raise ValueError(f"proposals must be [N, K] = [{n}, {k_max}], got {tuple(proposals.shape)}")
    fanout = torch.as_tensor(fanout, dtype=torch.long, device=glue_probs.device)
    fanout = torch.broadcast_to(fanout, (n, k_plus_1))
    limit = torch.full((k_plus_1,), vocab - 1, device=glue_probs.device)
    limit[-1] = vocab
    if bool((fanout < 0).any()) or bool((fanout > limit).any()):
        raise ValueError(f"fanout F_j must be in [0, V-1={vocab - 1}] for j < K and [0, V={vocab}] "
                         f"for j = K, got {fanout.tolist()}")
    order = _descending(glue_probs)  # [N, K+1, V]
    # Push the excluded proposal (depth j < K) to the end of its row's order, keeping the rest.
    excluded = torch.zeros_like(order, dtype=torch.bool)
    excluded[:, :k_max] = order[:, :k_max] == proposals[..., None]
    order = torch.gather(order, -1, torch.sort(excluded.to(torch.uint8), dim=-1, stable=True).indices)
    take = torch.arange(vocab, device=order.device) < fanout[..., None]  # [N, K+1, V]
    seq_index, depth, rank = take.nonzero(as_tuple=True)
    return Forks(seq_index=seq_index, depth=depth, token=order[seq_index, depth, rank])


def select_forks(
    glue_probs: torch.Tensor, proposals: torch.Tensor, fanout: Sequence[int]
) -> list[tuple[int, int]]:
    """Fork candidates (depth j, token) of one sequence; see :func:`select_forks_batched`.

    glue_probs: [K+1, V], proposals: [K], fanout: K+1 ints. Ordered by depth, then likelihood.
    """
    if glue_probs.dim() != 2 or proposals.dim() != 1:
        raise ValueError(f"glue_probs must be [K+1, V] and proposals [K], got "
                         f"{tuple(glue_probs.shape)} and {tuple(proposals.shape)}")
    if len(fanout) != glue_probs.shape[0]:
        raise ValueError(f"fanout must have K+1 = {glue_probs.shape[0]} entries, got {len(fanout)}")
    forks = select_forks_batched(glue_probs[None], proposals[None], torch.tensor(list(fanout)))
    return list(zip(forks.depth.tolist(), forks.token.tolist()))
