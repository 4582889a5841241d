"""Exact speculative verification (docs/algorithm.md section 5), batched over rows.

Every row is verified by the rule that matches how its proposals were *produced*:

- ratio rows: each proposal s_{i+1} was sampled from a known draft distribution q_i (plain or
  Saguaro q'). Accept with probability min(1, p_i(s) / q_i(s)); on the first rejection draw the
  bonus from normalize((p_i - q_i)+).
- point-mass rows: the proposals are deterministic (greedy draft at T > 0, random or n-gram
  tokens), i.e. q_i = delta_s. The same rule then reads: accept with probability p_i(s); on
  rejection draw from p_i with s removed and renormalised.
- greedy rows (temperature 0): p_i is one-hot at the argmax, so the point-mass rule accepts
  exactly while s == argmax p_i and the bonus is the argmax at the stop position. Greedy rows
  are always verified this way; their draft_probs are not needed.

If every valid proposal of a row is accepted the bonus is drawn from p at the row's last valid
position. Nothing here looks at cache hits or misses: exactness depends only on the row's q.

p at position i of a row whose params adjust the logits (penalties, logit_bias, bad words,
min_tokens) is processed with the row's history followed by its proposals before i: the history
plain decoding would have had there, had it emitted those proposals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from trtssd.sampling import (Generators, Histories, SamplingParams, draw_uniforms, processed_probs,
                             sample_with_uniforms)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification call.

    num_accepted:  [B] long, proposals accepted per row (0..num_proposals).
    bonus:         [B] long, the token the target emits after the accepted proposals.
    Row b emits proposals[b, :num_accepted[b]] followed by bonus[b].
    """

    num_accepted: torch.Tensor
    bonus: torch.Tensor


def verify(
    target_logits: torch.Tensor,
    proposals: torch.Tensor,
    num_proposals: torch.Tensor,
    draft_probs: torch.Tensor | None,
    point_mass: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Generators,
    history: Histories = None,
) -> VerifyResult:
    """Verify a batch of speculations exactly.

    target_logits: [B, K+1, V] raw target logits; row i scores the token after proposal i
                   (row 0: after the pending bonus token). Rows past num_proposals are ignored.
    proposals:     [B, K] long; entries past num_proposals[b] are ignored (may hold anything).
    num_proposals: [B] long in 0..K.
    draft_probs:   [B, K, V] the distributions the proposals were sampled from (q or Saguaro q'),
                   needed by ratio rows; None when every row is point-mass or greedy.
    point_mass:    [B] bool, the row's proposals are deterministic (draft_probs ignored).
    params:        one SamplingParams per row (defines p through trtssd.sampling.processed_probs).
    generators:    per-row RNGs (see trtssd.sampling.Generators); each row draws K+1 uniforms.
    history:       per row, the tokens before its first position (trtssd.sampling.History), or
                   None; needed by rows whose params adjust the logits.
    """
    batch, k_max, _ = _check_shapes(target_logits, proposals, num_proposals, draft_probs, point_mass)
    device = target_logits.device
    p = processed_probs(target_logits, params, _along_proposals(history, proposals, num_proposals))  # [B, K+1, V]
    greedy = torch.tensor([sp.is_greedy for sp in params], dtype=torch.bool, device=device)
    deterministic = point_mass.to(device=device, dtype=torch.bool) | greedy
    if draft_probs is None and not bool(deterministic.all()):
        raise ValueError("draft_probs is None but some rows are neither point_mass nor greedy")

    positions = torch.arange(k_max, device=device)
    valid = positions[None, :] < num_proposals[:, None]  # [B, K]
    tokens = torch.where(valid, proposals, torch.zeros_like(proposals))  # safe gather index
    p_at_s = p[:, :k_max, :].gather(-1, tokens[..., None])[..., 0]  # [B, K]
    if draft_probs is None:
        q_at_s = torch.ones_like(p_at_s)
    else:
        q_at_s = draft_probs.gather(-1, tokens[..., None])[..., 0].float()
        q_at_s = torch.where(deterministic[:, None], torch.ones_like(q_at_s), q_at_s)
        if bool((valid & (q_at_s <= 0)).any()):
            raise ValueError(
                "draft_probs gives probability 0 to a proposed token on a ratio row: the proposal "
                "was not sampled from this q (draft and target q have drifted apart)"
            )
    # u < ratio has probability exactly ratio for u ~ U[0, 1), also at ratio 0 and 1 (greedy rows).
    u = draw_uniforms(generators, batch, k_max + 1, device)
    ratio = torch.clamp(p_at_s / q_at_s, max=1.0)
    passes = (u[:, :k_max] < ratio) & valid
    num_accepted = passes.long().cumprod(dim=-1).sum(dim=-1)

    bonus_dist = _bonus_distribution(p, draft_probs, tokens, num_accepted, num_proposals, deterministic)
    bonus = sample_with_uniforms(bonus_dist, u[:, k_max])
    # Greedy rows: the distribution above is already one-hot; take its argmax explicitly.
    bonus = torch.where(greedy, bonus_dist.argmax(dim=-1), bonus)
    return VerifyResult(num_accepted, bonus)


def _along_proposals(history: Histories, proposals: torch.Tensor, num_proposals: torch.Tensor) -> Histories:
    """Each row's history followed by its valid proposals: position i sees the first i."""
    if history is None:
        return None
    rows, counts = proposals.tolist(), num_proposals.tolist()
    return [None if h is None else h.along(row[:n]) for h, row, n in zip(history, rows, counts)]


def _bonus_distribution(
    p: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    num_proposals: torch.Tensor,
    deterministic: torch.Tensor,
) -> torch.Tensor:
    """[B, V] (unnormalised) distribution of each row's bonus token.

    All valid proposals accepted: p at position num_proposals. Rejected at position k:
    (p_k - q_k)+, with q_k = delta_{s_{k+1}} on point-mass and greedy rows.
    """
    batch = p.shape[0]
    k_max = tokens.shape[1]
    rows = torch.arange(batch, device=p.device)
    p_stop = p[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_proposals
    if k_max == 0:
        return p_stop
    at = num_accepted.clamp(max=k_max - 1)  # only meaningful on rejected rows
    q_stop = torch.zeros_like(p_stop).scatter_(-1, tokens[rows, at][:, None], 1.0)
    if draft_probs is not None:
        q_stop = torch.where(deterministic[:, None], q_stop, draft_probs[rows, at].float())
    residual = torch.clamp(p_stop - q_stop, min=0.0)
    # In exact arithmetic a rejection implies p(s) < q(s), hence sum (p - q)+ = sum (q - p)+ > 0.
    # In fp32 the residual can still round to all zeros when p and q agree to rounding error
    # everywhere but s (a rejection with probability ~1e-7 in that case). Falling back to p there
    # changes the output distribution by at most that probability, far below any test's reach;
    # when p == q exactly the ratio is 1 and no rejection can happen at all.
    usable = rejected & (residual.sum(dim=-1) > 0)
    return torch.where(usable[:, None], residual, p_stop)


def _check_shapes(
    target_logits: torch.Tensor,
    proposals: torch.Tensor,
    num_proposals: torch.Tensor,
    draft_probs: torch.Tensor | None,
    point_mass: torch.Tensor,
) -> tuple[int, int, int]:
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, K+1, V], got {tuple(target_logits.shape)}")
    batch, k_plus_1, vocab = target_logits.shape
    k_max = k_plus_1 - 1
    if tuple(proposals.shape) != (batch, k_max) or proposals.dtype != torch.long:
        raise ValueError(f"proposals must be a long tensor [B, K] = [{batch}, {k_max}], got "
                         f"{proposals.dtype} {tuple(proposals.shape)}")
    if tuple(num_proposals.shape) != (batch,) or num_proposals.dtype != torch.long:
        raise ValueError(f"num_proposals must be a long tensor [B] = [{batch}], got "
                         f"{num_proposals.dtype} {tuple(num_proposals.shape)}")
    if tuple(point_mass.shape) != (batch,) or point_mass.dtype != torch.bool:
        raise ValueError(f"point_mass must be a bool tensor [B] = [{batch}], got "
                         f"{point_mass.dtype} {tuple(point_mass.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k_max, vocab):
        raise ValueError(f"draft_probs must be [B, K, V] = [{batch}, {k_max}, {vocab}], got "
                         f"{tuple(draft_probs.shape)}")
    if batch and (int(num_proposals.min()) < 0 or int(num_proposals.max()) > k_max):
        raise ValueError(f"num_proposals must be in [0, K={k_max}], got values in "
                         f"[{int(num_proposals.min())}, {int(num_proposals.max())}]")
    valid = torch.arange(k_max, device=proposals.device)[None, :] < num_proposals[:, None]
    if bool((valid & ((proposals < 0) | (proposals >= vocab))).any()):
        raise ValueError(f"proposals must be token ids in [0, V={vocab}) at valid positions")
    return batch, k_max, vocab
