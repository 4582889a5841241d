"""Speculation with penalties is exact: sampled output has the penalised target distribution at
every position, whatever proposed the tokens (a draft sampling its own penalised q, an unpenalised
draft, deterministic proposals), and a mutant that penalises the whole chain with one vector (the
committed output's counts) is caught.

The target is a Markov chain over V tokens (its next-token logits depend on the previous token),
but every adjustment of SamplingParams depends on the whole output before a position, so plain
sampling's distribution of x_1..x_{K+1} is enumerated over all V^(K+1) sequences:
P(x) = prod_t p(x_t | prompt, x_1..x_{t-1}), each p from `processed_probs` with that history.
The statistics are tests/exact_chain.py's: exact binomial tails per cell, Bonferroni at 1e-5.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import trtssd.spec_decode.verify as verify_module
from exact_chain import check_counts
from trtssd.sampling import History, SamplingParams, draw_uniforms, processed_probs, sample_with_uniforms
from trtssd.spec_decode.verify import verify

pytestmark = pytest.mark.slow

V = 5
K = 3
PROMPT = [0, 3]
N = 20_000
MUTANT_ROWS = 4_000
PARAMS = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=1.2, repetition_penalty=1.5,
                        logit_bias={2: 1.0}, bad_words_ids=[[1, 4]], min_tokens=2, stop_token_ids=[4], max_tokens=8)
FREE = SamplingParams(temperature=1.0)


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits [V, V] (row = previous token)."""
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(V, V, generator=g)
    return target, target + 0.8 * torch.randn(V, V, generator=g)


def _p(table: torch.Tensor, prefix: list[int], params: SamplingParams) -> torch.Tensor:
    last = (PROMPT + prefix)[-1]
    return processed_probs(table[last][None], [params], [History(PROMPT, prefix)])[0].double()


def exact_marginals(target: torch.Tensor):
    """Marginals of x_1..x_{K+1} and of the pairs (x_t, x_{t+1}) under plain penalised sampling."""
    length = K + 1
    marginals = torch.zeros(length, V, dtype=torch.float64)
    pairs = torch.zeros(length - 1, V * V, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=length):
        prob = 1.0
        for t in range(length):
            prob *= float(_p(target, list(seq[:t]), PARAMS)[seq[t]])
            if prob == 0:
                break
        for t in range(length):
            marginals[t, seq[t]] += prob
        for t in range(length - 1):
            pairs[t, seq[t] * V + seq[t + 1]] += prob
    return marginals, pairs


def _propose(draft: torch.Tensor, outputs: list[list[int]], proposer: str):
    """K proposals per row and the rows q they were drawn from (None: deterministic)."""
    n = len(outputs)
    u = draw_uniforms(None, n, K)
    tokens = [[] for _ in range(n)]
    qs = []
    for d in range(K):
        last = torch.tensor([(PROMPT + out + tok)[-1] for out, tok in zip(outputs, tokens)])
        if proposer == "penalised":  # the draft's own q, processed with its chain so far
            q = processed_probs(draft[last], [PARAMS] * n, [History(PROMPT, out + tok) for out, tok in zip(outputs, tokens)])
        else:
            q = processed_probs(draft[last], [FREE] * n)
        chosen = draft[last].argmax(-1) if proposer == "argmax" else sample_with_uniforms(q, u[:, d])
        for row, t in zip(tokens, chosen.tolist()):
            row.append(t)
        qs.append(q)
    return tokens, None if proposer == "argmax" else torch.stack(qs, dim=1)


def simulate(target: torch.Tensor, draft: torch.Tensor, proposer: str, rows: int, seed: int) -> torch.Tensor:
    """Speculative rounds until every row has K + 1 tokens -> [rows, K + 1]."""
    torch.manual_seed(seed)
    out = [[] for _ in range(rows)]
    active = list(range(rows))
    while active:
        outputs = [out[r] for r in active]
        tokens, q = _propose(draft, outputs, proposer)
        chains = torch.tensor([[(PROMPT + o)[-1]] + t for o, t in zip(outputs, tokens)])
        result = verify(target[chains], torch.tensor(tokens), torch.full((len(active),), K), q,
                        torch.full((len(active),), q is None), [PARAMS] * len(active), None,
                        [History(PROMPT, o) for o in outputs])
        still = []
        for j, r in enumerate(active):
            n = int(result.num_accepted[j])
            out[r] += (tokens[j][:n] + [int(result.bonus[j])])[:K + 1 - len(out[r])]
            if len(out[r]) < K + 1:
                still.append(r)
        active = still
    return torch.tensor(out)


def _check(target: torch.Tensor, samples: torch.Tensor):
    marginals, pairs = exact_marginals(target)
    parts = [(f"x{t + 1}", samples[:, t], marginals[t]) for t in range(K + 1)]
    parts += [(f"(x{t + 1}, x{t + 2})", samples[:, t] * V + samples[:, t + 1], pairs[t]) for t in range(K)]
    return check_counts(parts)


@pytest.mark.parametrize("proposer", ["penalised", "free", "argmax"])
def test_sampled_speculation_has_the_penalised_distribution_at_every_position(proposer):
    target, draft = _tables(1)
    check = _check(target, simulate(target, draft, proposer, N, seed=2))
    assert check.ok, check


def test_one_penalty_vector_for_the_whole_chain_is_caught(monkeypatch):
    """The classic bug: every position of a verify chain processed with the committed output's
    counts, as if the proposals before it had not been emitted."""
    monkeypatch.setattr(verify_module, "_along_proposals", lambda history, proposals, num_proposals: history)
    target, draft = _tables(1)
    check = _check(target, simulate(target, draft, "penalised", MUTANT_ROWS, seed=3))
    assert not check.ok, check


def test_the_enumeration_is_a_distribution_that_the_penalties_shape():
    target, _ = _tables(1)
    marginals, pairs = exact_marginals(target)
    assert torch.allclose(marginals.sum(-1), torch.ones(K + 1, dtype=torch.float64))
    assert marginals[0, 4] == 0 and marginals[1, 4] == 0 and marginals[2, 4] > 0  # min_tokens holds back 4
    assert pairs[0].view(V, V)[1, 4] == 0  # the bad word (1, 4) never completes
    # Presence and frequency: a token right after itself is rarer than without the penalties.
    assert pairs[0].view(V, V).diagonal().sum() < 0.5 * pairs[0].sum() / V
