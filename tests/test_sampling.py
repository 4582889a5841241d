"""SamplingParams validation and the logits -> p map, checked against a plain loop implementation."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from trtssd.sampling import (SamplingParams, draw_uniforms, make_generator, processed_logprobs, processed_probs,
                             sample, sample_with_uniforms, token_logprobs)


def reference_probs(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """One row, float64, written for clarity: temperature, top-k, top-p, min-p (HF order)."""
    vocab = len(logits)
    if sp.temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(logits))] = 1.0
        return out
    x = logits.astype(np.float64) / sp.temperature
    keep = np.ones(vocab, dtype=bool)

    def probs():
        e = np.where(keep, np.exp(x - x[keep].max()), 0.0)
        return e / e.sum()

    if sp.top_k > 0:
        kth = np.sort(x)[::-1][min(sp.top_k, vocab) - 1]
        keep &= x >= kth
    if sp.top_p < 1:
        p = probs()
        mass = 0.0
        for token in np.argsort(-x, kind="stable"):
            if not keep[token]:
                continue
            if mass >= sp.top_p:
                keep[token] = False
            mass += p[token]
    if sp.min_p > 0:
        p = probs()
        keep &= p >= sp.min_p * p.max()
    return probs()


# ---- SamplingParams ---------------------------------------------------------------------------


def test_defaults_and_greedy_flag():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.max_tokens) == (1.0, 0, 1.0, 0.0, 128)
    assert not sp.is_greedy and SamplingParams(temperature=0).is_greedy


def test_lists_become_tuples_and_params_are_frozen_and_hashable():
    sp = SamplingParams(stop=["\n\n", "END"], stop_token_ids=[2, 7])
    assert sp.stop == ("\n\n", "END") and sp.stop_token_ids == (2, 7)
    assert hash(sp) == hash(SamplingParams(stop=("\n\n", "END"), stop_token_ids=(2, 7)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.temperature = 0.5


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
    ("top_k", -1), ("top_k", 2.0), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", -0.1), ("min_p", 1.0),
    ("max_tokens", -1), ("max_tokens", 1.5),
    ("stop", ("",)), ("stop", "END"), ("stop", (3,)),
    ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)),
    ("ignore_eos", 1),
    ("seed", -1), ("seed", 2**64), ("seed", 1.0),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", True), ("logprobs", 2.0),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**{field: value})


# ---- processed_probs ----------------------------------------------------------------------------


def test_processed_probs_matches_the_reference_for_mixed_rows():
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    batch, n, vocab = 64, 3, 12
    logits = 2 * torch.randn(batch, n, vocab, generator=g)
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.5, 1.0, 1.7])),
                             top_k=int(rng.choice([0, 1, 3, 20])),
                             top_p=float(rng.choice([1.0, 0.9, 0.5])),
                             min_p=float(rng.choice([0.0, 0.05, 0.3]))) for _ in range(batch)]
    p = processed_probs(logits, params)
    assert p.dtype == torch.float32 and p.shape == logits.shape
    for b in range(batch):
        for i in range(n):
            expected = reference_probs(logits[b, i].numpy(), params[b])
            np.testing.assert_allclose(p[b, i].numpy(), expected, atol=2e-6, err_msg=f"{params[b]}")


def test_processed_logprobs_are_the_log_of_p_and_greedy_rows_the_raw_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = 2 * torch.randn(4, 3, 40, generator=g)
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
              SamplingParams(temperature=0), SamplingParams()]
    logp, p = processed_logprobs(logits, params), processed_probs(logits, params)
    for b in (0, 1, 3):
        kept = p[b] > 0
        assert torch.equal(torch.isfinite(logp[b]), kept)
        torch.testing.assert_close(logp[b][kept], p[b][kept].log(), atol=1e-5, rtol=0)
    torch.testing.assert_close(logp[2], torch.log_softmax(logits[2], dim=-1), atol=0, rtol=0)
    assert torch.equal(processed_logprobs(logits[:, 0], params), logp[:, 0])  # [B, V] input


def test_token_logprobs_give_each_token_and_its_finite_alternatives_most_likely_first():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    got = token_logprobs(logits, [1, 2], SamplingParams(temperature=1.0, top_k=2, logprobs=3))
    logp = processed_logprobs(logits[None], [SamplingParams(temperature=1.0, top_k=2)])[0]
    assert [e.token_id for e in got] == [1, 2]
    assert got[0].logprob == -math.inf  # token 1 is outside row 0's top-2 (never emitted so in practice)
    assert [t for t, _ in got[0].top] == [0, 2] and [t for t, _ in got[1].top] == [2, 3]  # only 2 are finite
    assert got[1].top[0][1] == pytest.approx(float(logp[1, 2]))
    assert token_logprobs(logits, [0, 2], SamplingParams(logprobs=0))[0].top == ()


def test_top_k_keeps_ties_and_k_beyond_vocab_keeps_all():
    logits = torch.tensor([[3.0, 3.0, 1.0, 0.0]])
    p = processed_probs(logits, [SamplingParams(top_k=1)])
    assert torch.allclose(p, torch.tensor([[0.5, 0.5, 0.0, 0.0]]))
    assert torch.allclose(processed_probs(logits, [SamplingParams(top_k=99)]), torch.softmax(logits, -1))


def test_a_row_does_not_depend_on_the_other_rows_settings():
    # A peaked row: its tail mass is below fp32 resolution next to the peak.
    logits = torch.zeros(2, 1000)
    logits[:, 0] = 30.0
    alone = processed_probs(logits[:1], [SamplingParams()])
    mixed = processed_probs(logits, [SamplingParams(), SamplingParams(top_p=0.5, top_k=3)])
    assert torch.equal(mixed[:1], alone) and (alone > 0).all()


def test_greedy_is_one_hot_with_first_index_on_ties_and_2d_input():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    p = processed_probs(logits, [SamplingParams(temperature=0)] * 2)
    assert p.dtype == torch.float32
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_masked_vocab_entries_stay_zero():
    logits = torch.tensor([[1.0, -math.inf, 0.5, -math.inf]])
    p = processed_probs(logits, [SamplingParams(temperature=0.7, top_p=0.95)])
    assert p[0, 1] == 0 and p[0, 3] == 0 and torch.isclose(p.sum(), torch.tensor(1.0))


def test_processed_probs_rejects_bad_shapes():
    with pytest.raises(ValueError, match="params"):
        processed_probs(torch.randn(2, 3, 4), [SamplingParams()])
    with pytest.raises(ValueError, match="logits"):
        processed_probs(torch.randn(4), [SamplingParams()])


# ---- sampling -----------------------------------------------------------------------------------


def test_sample_follows_the_distribution():
    p = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.3])
    n = 100_000
    draws = sample(p.expand(n, -1), torch.Generator().manual_seed(3))
    freq = torch.bincount(draws, minlength=5).double() / n
    sigma = torch.sqrt(p * (1 - p) / n).double().clamp(min=1e-12)
    assert freq[1] == 0
    assert ((freq - p).abs() / sigma).max() < 4.5
    # The same check sees a shift of 0.01.
    assert ((freq - (p + torch.tensor([0.01, 0, -0.01, 0, 0]))).abs() / sigma).max() > 4.5


def test_inverse_cdf_edges_never_pick_zero_mass_tokens():
    p = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.0, 0.3, 0.7, 0.0]])
    u = torch.tensor([0.0, 1.0 - 2**-24])
    assert sample_with_uniforms(p, u).tolist() == [1, 2]
    unnormalised = torch.tensor([[0.0, 3.0, 1.0]])
    assert sample_with_uniforms(unnormalised, torch.tensor([0.74])).tolist() == [1]
    assert sample_with_uniforms(unnormalised, torch.tensor([0.76])).tolist() == [2]


def test_seeded_rows_sample_by_inverse_cdf_from_their_own_generator():
    assert make_generator(SamplingParams()) is None
    seeds = [1234, 7, 99, 2**63 - 1, 0, 5, 6, 8]
    p = torch.softmax(torch.randn(8, 20, generator=torch.Generator().manual_seed(4)), -1)
    got = sample(p, [make_generator(SamplingParams(seed=s)) for s in seeds])
    # By hand: row i's uniform is the first number of its seed's stream, and the token is the
    # first whose float64 cumulative mass exceeds it.
    for i, seed in enumerate(seeds):
        u = float(torch.rand(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
        cdf = np.cumsum(p[i].double().numpy())
        assert int(got[i]) == int(np.searchsorted(cdf, u * cdf[-1], side="right")), seed
    u = draw_uniforms([None, make_generator(SamplingParams(seed=1234)), None], 3, 4)
    assert torch.equal(u[1], torch.rand(4, generator=torch.Generator().manual_seed(1234), dtype=torch.float64))
    assert ((u >= 0) & (u < 1)).all()
    with pytest.raises(ValueError, match="generators"):
        draw_uniforms([None], 2, 1)


def _exact_inverse_cdf(cdf: list[int], k: int) -> tuple[int, float]:
    """For u = k / 2^24 (the grid torch.rand's fp32 numbers lie on) and an integer CDF: the first
    token whose cumulative mass exceeds u * total, and how far u * total is from the nearest CDF
    value, in grid steps."""
    total = cdf[-1]
    scaled = k * total  # u * total * 2^24, exactly
    # cdf[j] > u * total  <=>  cdf[j] > floor(u * total), cdf[j] being an integer
    token = bisect.bisect_right(cdf, scaled >> 24)
    below = (cdf[token - 1] << 24) if token else 0
    above = cdf[token] << 24
    return token, min(scaled - below, above - scaled) / total


def test_inverse_cdf_boundaries_are_exact_at_a_49k_vocabulary():
    # At V = 49152 an fp32 cumulative sum rounds every token's increment (~2e-5) to the ulp of the
    # running sum, which moves boundaries between neighbouring tokens (~3e-4 of the mass in all).
    # Check boundaries directly against exact rational arithmetic: for random tokens i, the two
    # fp32 grid points on either side of the start of token i's interval.
    vocab = 49152
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(vocab, generator=g), -1)
    q = torch.softmax(torch.randn(vocab, generator=g), -1)
    for name, probs in (("target row", p), ("bonus residual (p - q)+", (p - q).clamp(min=0))):
        # Every fp32 number is an integer multiple of 2^-149, so this CDF is exact.
        cdf = list(itertools.accumulate(int(Fraction(x) * 2**149) for x in probs.tolist()))
        points, expected = [], []
        for i in torch.randint(1, vocab, (64,), generator=g).tolist():
            k_first = -(-(cdf[i - 1] << 24) // cdf[-1])  # the first grid point past cdf(i - 1)
            for k in (k_first - 1, k_first):
                token, margin = _exact_inverse_cdf(cdf, k)
                # float64 sums are exact to ~1e-12 of a step; points closer than that are ambiguous
                if margin > 1e-6:
                    points.append(k)
                    expected.append(token)
        u = torch.tensor(points, dtype=torch.float64).div(2**24).float()  # exact in fp32
        got = sample_with_uniforms(probs.expand(len(points), -1), u)
        wrong = [(k, e, int(t)) for k, e, t in zip(points, expected, got) if e != int(t)]
        assert not wrong, f"{name}: {len(wrong)} of {len(points)} points misplaced, e.g. {wrong[:3]}"
