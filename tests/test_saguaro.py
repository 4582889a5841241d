"""Saguaro q' and fork selection (docs/algorithm.md sections 3 and 6)."""

from __future__ import annotations

import pytest
import torch

from trtssd.spec_decode.saguaro import saguaro_probs, select_forks, select_forks_batched, top_tokens


def _random_q(seed: int, rows: int, vocab: int, spread: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(spread * torch.randn(rows, vocab, generator=g), -1)


def test_top_f_plus_one_are_scaled_by_c_and_the_rest_keep_their_ratios():
    q = _random_q(0, 50, 10)
    fanout = torch.randint(-1, 9, (50,), generator=torch.Generator().manual_seed(1))
    c = 0.3
    q2 = saguaro_probs(q, fanout, c)
    assert torch.allclose(q2.sum(-1), torch.ones(50))
    for row in range(50):
        top = set(torch.argsort(q[row], descending=True)[: int(fanout[row]) + 1].tolist())
        if fanout[row] < 0:
            top = set()
        factor = torch.tensor([c if t in top else 1.0 for t in range(10)])
        expected = q[row] * factor / (q[row] * factor).sum()
        assert torch.allclose(q2[row], expected, atol=1e-7), (row, int(fanout[row]))


def reference_q_prime(q_row: list[float], f: int, c: float) -> list[float]:
    """One row in float64, written for clarity: rank tokens by probability (ties to the lower id),
    multiply the first F + 1 by c, renormalise."""
    ranked = sorted(range(len(q_row)), key=lambda t: (-q_row[t], t))
    scaled = set(ranked[: f + 1]) if f >= 0 else set()
    weights = [q * c if t in scaled else q for t, q in enumerate(q_row)]
    return [w / sum(weights) for w in weights]


def test_a_hand_computed_row():
    # Top-2 of q are tokens 0 and 2 (ties inside the top set: tokens 1 and 3 below are never both
    # in or out). c = 0.5: weights 0.2, 0.1, 0.15, 0.2, total 0.65.
    q = torch.tensor([[0.4, 0.1, 0.3, 0.2]])
    expected = torch.tensor([[0.2, 0.1, 0.15, 0.2]]) / 0.65
    assert torch.allclose(saguaro_probs(q, 1, 0.5), expected, atol=1e-7)
    # Tokens 1 and 2 tie at 0.3 inside the top 2; token 3 (0.2) is the third.
    q = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1]])
    expected = torch.tensor([[0.1, 0.15, 0.15, 0.2, 0.1]]) / 0.7
    assert torch.allclose(saguaro_probs(q, 1, 0.5), expected, atol=1e-7)


def test_per_depth_fanout_matches_the_reference_at_every_depth():
    q = _random_q(2, 30 * 4, 9).reshape(30, 4, 9)  # [rows, depth, V], as the draft ships them
    fanout = torch.tensor([3, 2, 1, 0])  # F_j per depth, broadcast over the rows
    q2 = saguaro_probs(q, fanout, 0.5)
    for row in range(30):
        for depth in range(4):
            expected = reference_q_prime(q[row, depth].tolist(), int(fanout[depth]), 0.5)
            assert torch.allclose(q2[row, depth], torch.tensor(expected, dtype=torch.float32), atol=1e-7)


def test_identity_cases_and_bad_c():
    q = _random_q(3, 4, 6)
    assert saguaro_probs(q, 2, 1.0) is q
    assert torch.allclose(saguaro_probs(q, -1, 0.3), q)
    one_hot = torch.eye(6)[:3]  # greedy draft: Saguaro has no effect at temperature 0
    assert torch.equal(saguaro_probs(one_hot, 2, 0.3), one_hot)
    for bad in (0.0, -0.5, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="c must be"):
            saguaro_probs(q, 2, bad)


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    # The draft computes q' for a whole batch and ships it; a row must come out bit-identical to
    # the same row computed alone, although the batch's widest fan-out sets the top-k width and
    # the other rows differ.
    q = _random_q(4, 200, 32)
    fanout = torch.randint(-1, 6, (200,), generator=torch.Generator().manual_seed(12))
    batch = saguaro_probs(q, fanout, 0.7)
    for row in range(0, 200, 3):
        expected = torch.tensor(reference_q_prime(q[row].tolist(), int(fanout[row]), 0.7))
        assert torch.allclose(batch[row], expected.float(), atol=1e-7), row
        if fanout[row] >= 0:
            assert torch.equal(batch[row], saguaro_probs(q[row], int(fanout[row]), 0.7)), row
        # An F < 0 row alone comes back as q itself, but inside a batch with scaled rows it is
        # renormalised (equal to q only up to rounding), so bit-identity is checked for F >= 0.


def _residual_share_on(p, q2, members):
    residual = (p - q2).clamp(min=0)
    return (residual * members).sum(-1) / residual.sum(-1).clamp(min=1e-30)


def test_lowering_c_raises_the_residual_share_on_the_cached_candidates():
    rows, vocab, f = 2000, 12, 3
    p, q = _random_q(5, rows, vocab), _random_q(6, rows, vocab)
    top = torch.zeros(rows, vocab).scatter_(-1, torch.argsort(q, -1, descending=True)[:, : f + 1], 1.0)
    shares = [_residual_share_on(p, saguaro_probs(q, f, c), top) for c in (1.0, 0.7, 0.3)]
    assert (shares[1] >= shares[0] - 1e-6).all() and (shares[2] >= shares[1] - 1e-6).all()
    assert shares[2].mean() > shares[0].mean() + 0.05


def _exact_bonus_hit_rate(p, q, f, c):
    """P(rejected and the bonus is one of the top-F forks excluding the proposal), exact sum over s."""
    q2 = saguaro_probs(q[None], f, c)[0]
    residual = (p - q2).clamp(min=0)
    hit = 0.0
    for s in range(len(p)):
        reject = 1 - min(1.0, float(p[s] / q2[s]))
        forks = [t for _, t in select_forks(torch.stack([q, q]), torch.tensor([s]), [f, 0])]
        hit += float(q2[s]) * reject * float(residual[forks].sum() / residual.sum())
    return hit


def test_lowering_c_raises_the_cache_hit_rate_after_a_rejection():
    p, q = _random_q(7, 40, 8), _random_q(8, 40, 8)
    rates = [sum(_exact_bonus_hit_rate(p[i], q[i], 2, c) for i in range(40)) / 40 for c in (1.0, 0.7, 0.3)]
    assert rates[0] < rates[1] < rates[2], rates


# ---- fork selection -------------------------------------------------------------------------------


def test_forks_exclude_the_proposal_below_depth_k_but_not_at_depth_k():
    glue = torch.tensor([
        [0.5, 0.2, 0.15, 0.1, 0.05],  # depth 0, proposal 0 (the most likely) is excluded
        [0.1, 0.6, 0.1, 0.1, 0.1],  # depth 1, proposal 4 (not in the top) changes nothing
        [0.05, 0.05, 0.1, 0.3, 0.5],  # depth K = 2, nothing excluded
    ])
    forks = select_forks(glue, torch.tensor([0, 4]), [2, 2, 3])
    # ties (0.1 at tokens 0, 2, 3 of depth 1) go to the lower token id
    assert forks == [(0, 1), (0, 2), (1, 1), (1, 0), (2, 4), (2, 3), (2, 2)]
    assert select_forks(glue, torch.tensor([0, 4]), [0, 0, 1]) == [(2, 4)]


def test_batched_forks_match_single_sequence_forks():
    n, k, vocab = 6, 3, 10
    glue = _random_q(9, n * (k + 1), vocab).reshape(n, k + 1, vocab)
    proposals = torch.randint(0, vocab, (n, k), generator=torch.Generator().manual_seed(10))
    fanout = torch.tensor([[3, 2, 1, 4]] * 3 + [[1, 1, 1, 1]] * 3)
    forks = select_forks_batched(glue, proposals, fanout)
    for i in range(n):
        mine = forks.seq_index == i
        single = select_forks(glue[i], proposals[i], fanout[i].tolist())
        assert list(zip(forks.depth[mine].tolist(), forks.token[mine].tolist())) == single
        assert len(single) == int(fanout[i].sum())
        for depth in range(k):
            assert (depth, int(proposals[i, depth])) not in single


def test_without_proposals_the_forks_are_the_top_guesses_ties_included():
    """K = 0, a new sequence's first token: the top-F of top_tokens itself, even where a tie
    straddles rank F (ranking F + 1 tokens could fork the other tied one)."""
    q = torch.tensor([[0.4, 0.15, 0.15, 0.15, 0.15, 0.0, 0.0, 0.0]])
    for f in range(8):
        assert select_forks(q, torch.zeros(0, dtype=torch.long), [f]) == [(0, t) for t in top_tokens(q[0], f).tolist()]


def test_bad_fanout_is_rejected():
    glue, proposals = _random_q(11, 3, 4), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="fanout"):
        select_forks(glue, proposals, [4, 1, 1])  # only V-1 = 3 candidates exist below depth K
    with pytest.raises(ValueError, match="fanout"):
        select_forks(glue, proposals, [1, -1, 1])
    with pytest.raises(ValueError, match="fanout"):
        select_forks(glue, proposals, [1, 1])
