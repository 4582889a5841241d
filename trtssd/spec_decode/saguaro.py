"""Saguaro: the cache-aware draft distribution q' and fork selection (docs/algorithm.md
sections 3, 6).

After a rejection at depth j the bonus is drawn from (p_j - q_j)+. The draft caches speculations
for its top-F_j guesses of that bonus. Sampling s_{j+1} from q'_j instead of q_j, where q'_j
scales q_j's top-(F_j + 1) probabilities by C <= 1, lowers q' on exactly those guesses, which
raises the residual mass there and so the cache hit rate. Verification stays exact because the
target verifies with the same q' rows the draft sampled from (trtssd.spec_decode.verify).

Both functions rank tokens the same way (`top_tokens`: descending probability, ties to the lower id),
so the scaled set and the fork candidates agree. Only the top few ranks are ever needed, so they
come from a top-k, not a sort of the whole vocabulary (a 49k-wide sort costs ~6 ms per row on a
CPU core).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def top_tokens(q: torch.Tensor, m: int) -> torch.Tensor:
    """Ids of the m most probable tokens of each row [..., m], most probable first.

    Ties inside the top m go to the lower id. A tie straddling rank m is broken by topk's own
    order; that can only move which of two equally likely tokens is scaled or forked, never
    exactness (the target verifies with the rows actually shipped).
    """
    m = min(m, q.shape[-1])
    values, ids = torch.topk(q, m, dim=-1, sorted=True)
    by_id = torch.sort(ids, dim=-1).indices  # lower id first, then a stable sort on the value
    ids, values = ids.gather(-1, by_id), values.gather(-1, by_id)
    return ids.gather(-1, torch.sort(values, dim=-1, descending=True, stable=True).indices)


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
    fanout = torch.as_tensor(fanout, dtype=torch.long, device=q.device)
    fanout = torch.broadcast_to(fanout, q.shape[:-1])
    q = q.float()
    m = int(fanout.max()) + 1 if fanout.numel() else 0
    if m <= 0:
        return q
    top = top_tokens(q, m)  # [..., m]
    take = torch.arange(top.shape[-1], device=q.device) < (fanout[..., None] + 1)  # F < 0 -> none
    scaled = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, top, take)
    weighted = torch.where(scaled, q * c, q)
    # Rows with nothing scaled stay q bit for bit (renormalising would move them by rounding).
    return torch.where(scaled.any(dim=-1, keepdim=True), weighted / weighted.sum(dim=-1, keepdim=True), q)


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
                Only its order counts: a greedy row may pass its logits. K = 0: guesses of
                the token after the prompt (no speculation yet).
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
    # One more than the widest fan-out where a row may have to skip its excluded proposal.
    order = top_tokens(glue_probs, (int(fanout.max()) if fanout.numel() else 0) + (1 if k_max else 0))
    # Push the excluded proposal (depth j < K) to the end of its row's order, keeping the rest.
    excluded = torch.zeros_like(order, dtype=torch.bool)
    excluded[:, :k_max] = order[:, :k_max] == proposals[..., None]
    order = torch.gather(order, -1, torch.sort(excluded.to(torch.uint8), dim=-1, stable=True).indices)
    take = torch.arange(order.shape[-1], device=order.device) < fanout[..., None]  # [N, K+1, m]
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
