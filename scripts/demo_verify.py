"""Demonstration of the verification and Saguaro maths on a synthetic Markov "language" (CPU, seconds).

A target and a draft are next-token tables over a small vocabulary (the next token depends only
on the previous one). For many independent rows, the draft proposes K tokens (from Saguaro q'),
the target verifies them exactly, and the draft's fork candidates for the outcome are checked
for a cache hit. Logged: acceptance per position, tokens per round, the cache hit rate for
several C, how far the first emitted token's frequencies are from the target's distribution,
and the same for the SSD reference's inexact "accept only the argmax" rule.

    python scripts/demo_verify.py --rows 50000 --k 4 --vocab 8
"""

from __future__ import annotations

import argparse
import logging

import torch

from trtssd.sampling import SamplingParams, processed_probs, sample
from trtssd.spec_decode.fanout import AcceptanceEstimator, continuous_fanout, optimal_fanout
from trtssd.spec_decode.saguaro import saguaro_probs, select_forks_batched
from trtssd.spec_decode.verify import verify

log = logging.getLogger("demo_verify")


def run(rows: int, k: int, vocab: int, budget: int, c: float, seed: int, random_proposals: bool = False,
        reference_rule: bool = False) -> dict:
    """One round for ``rows`` rows from context token 0; returns summary numbers.

    random_proposals: uniform random tokens (a fast backup) verified as point masses;
    reference_rule: verify them instead by the reference's "accept only the argmax" rule.
    """
    g = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(vocab, vocab, generator=g)
    draft_q = torch.softmax(target_logits + 0.7 * torch.randn(vocab, vocab, generator=g), -1)
    params = SamplingParams(temperature=1.0)
    p_table = processed_probs(target_logits[None], [params])[0]
    fanout = optimal_fanout(budget, k, a=0.7, r=1.0)

    context = torch.zeros(rows, dtype=torch.long)
    prev, tokens, shipped, glue = context, [], [], []
    for depth in range(k):
        q = draft_q[prev]
        q_prime = saguaro_probs(q, fanout[depth], c)
        glue.append(q)
        shipped.append(q_prime)
        prev = torch.randint(0, vocab, (rows,), generator=g) if random_proposals else sample(q_prime, g)
        tokens.append(prev)
    glue.append(draft_q[prev])
    proposals = torch.stack(tokens, 1)
    logits = target_logits[torch.cat([context[:, None], proposals], 1)]
    point_mass = torch.full((rows,), random_proposals)
    num = torch.full((rows,), k)
    if reference_rule:
        p = processed_probs(logits, [params] * rows)
        match = proposals == p[:, :k].argmax(-1)
        accepted = match.long().cumprod(-1).sum(-1)
        bonus = sample(p[torch.arange(rows), accepted], g)
    else:
        res = verify(logits, proposals, num, torch.stack(shipped, 1), point_mass, [params] * rows, g)
        accepted, bonus = res.num_accepted, res.bonus

    forks = select_forks_batched(torch.stack(glue, 1), proposals, torch.tensor(fanout))
    cached = torch.zeros(rows, k + 1, vocab, dtype=torch.bool)
    cached[forks.seq_index, forks.depth, forks.token] = True
    hit = cached[torch.arange(rows), accepted, bonus]

    first = torch.where(accepted > 0, proposals[:, 0], bonus)
    freq = torch.bincount(first, minlength=vocab).double() / rows
    estimator = AcceptanceEstimator()
    estimator.update(accepted, num)
    return {
        "fanout": fanout,
        "accept_per_position": [round(float((accepted > i).float().mean()), 3) for i in range(k)],
        "tokens_per_round": round(float(accepted.float().mean() + 1), 3),
        "estimated_a": round(estimator.value, 3),
        "hit_rate": round(float(hit.float().mean()), 3),
        "first_token_max_abs_error": round(float((freq - p_table[0].double()).abs().max()), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000, help="independent rows (sequences)")
    parser.add_argument("--k", type=int, default=4, help="lookahead K")
    parser.add_argument("--vocab", type=int, default=8, help="vocabulary size")
    parser.add_argument("--budget", type=int, default=8, help="fork budget B per sequence")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)

    log.info("section 7 example, continuous fan-out K=7 B=24 a=0.8 r=1: %s",
             [round(f, 2) for f in continuous_fanout(24, 7, 0.8, 1.0)])
    noise = 1 / args.rows**0.5
    log.info("rows=%d K=%d V=%d budget=%d (one standard deviation of a frequency <= %.4f)",
             args.rows, args.k, args.vocab, args.budget, noise / 2)
    for c in (1.0, 0.7, 0.3):
        log.info("Saguaro C=%.1f: %s", c, run(args.rows, args.k, args.vocab, args.budget, c, args.seed))
    log.info("random proposals, exact point-mass rule: %s",
             run(args.rows, args.k, args.vocab, args.budget, 1.0, args.seed, random_proposals=True))
    log.info("random proposals, reference argmax rule (biased): %s",
             run(args.rows, args.k, args.vocab, args.budget, 1.0, args.seed, random_proposals=True,
                 reference_rule=True))


if __name__ == "__main__":
    main()
