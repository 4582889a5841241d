"""Unit-level properties of trtssd.spec_decode.verify: deterministic ones, and one-position statistics
(the statistics over whole speculations are in test_exactness.py)."""

from __future__ import annotations

import pytest
import torch

from exact_chain import check_counts
from trtssd.sampling import SamplingParams, make_generator, processed_probs
from trtssd.spec_decode.verify import _bonus_distribution, verify

GREEDY = SamplingParams(temperature=0.0)
WARM = SamplingParams(temperature=1.0)


def _random_case(seed: int, batch: int, k: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=g)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    proposals = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
    return g, logits, q, proposals


def test_greedy_verification_equals_the_argmax_chain():
    batch, k, vocab = 2000, 5, 11
    g, logits, q, _ = _random_case(0, batch, k, vocab)
    chain = logits.argmax(-1)  # what plain greedy decoding emits at each position
    proposals = chain[:, :k].clone()
    # Corrupt each row at a random position (or nowhere when it draws k).
    first_wrong = torch.randint(0, k + 1, (batch,), generator=g)
    rows = torch.nonzero(first_wrong < k)[:, 0]
    proposals[rows, first_wrong[rows]] = (chain[rows, first_wrong[rows]] + 1) % vocab
    num = torch.full((batch,), k)
    # draft_probs are given and point_mass is False: greedy rows must ignore both.
    res = verify(logits, proposals, num, q, torch.zeros(batch, dtype=torch.bool), [GREEDY] * batch, None)
    assert torch.equal(res.num_accepted, first_wrong)
    assert torch.equal(res.bonus, chain[torch.arange(batch), first_wrong])


def test_greedy_rows_are_unaffected_by_warm_rows_in_the_same_batch():
    batch, k, vocab = 400, 3, 9
    g, logits, q, proposals = _random_case(1, batch, k, vocab)
    num = torch.randint(0, k + 1, (batch,), generator=g)
    mixed = [GREEDY if i % 2 else WARM for i in range(batch)]
    res = verify(logits, proposals, num, q, torch.zeros(batch, dtype=torch.bool), mixed, g)
    odd = torch.arange(1, batch, 2)
    alone = verify(logits[odd], proposals[odd], num[odd], None, torch.ones(len(odd), dtype=torch.bool),
                   [GREEDY] * len(odd), None)
    assert torch.equal(res.num_accepted[odd], alone.num_accepted)
    assert torch.equal(res.bonus[odd], alone.bonus)


def test_all_accepted_takes_the_bonus_from_p_at_the_last_valid_position():
    batch, k, vocab = 64, 4, 7
    g, logits, _, _ = _random_case(2, batch, k, vocab)
    num = torch.randint(0, k + 1, (batch,), generator=g)
    special = torch.randint(0, vocab, (batch,), generator=g)
    # p at each row's last valid position is (numerically) one-hot on `special`.
    logits[torch.arange(batch), num] = -1e4
    logits[torch.arange(batch), num, special] = 1e4
    p = processed_probs(logits, [WARM] * batch)
    proposals = p[:, :k].argmax(-1)
    # Draft q = p exactly, so p/q = 1 and nothing can be rejected.
    no_point_mass = torch.zeros(batch, dtype=torch.bool)
    res = verify(logits, proposals, num, p[:, :k].clone(), no_point_mass, [WARM] * batch, g)
    assert torch.equal(res.num_accepted, num)
    assert torch.equal(res.bonus, special)


def test_a_rejected_proposal_is_never_the_bonus():
    batch, k, vocab = 5000, 3, 6
    g, logits, q, proposals = _random_case(3, batch, k, vocab)
    num = torch.full((batch,), k)
    point = torch.arange(batch) % 2 == 0
    res = verify(logits, proposals, num, q, point, [WARM] * batch, g)
    rejected = res.num_accepted < num
    assert rejected.sum() > 1000
    at = res.num_accepted[rejected]
    assert not (proposals[rejected, at] == res.bonus[rejected]).any()


def test_positions_past_num_proposals_are_ignored():
    batch, k, vocab = 300, 4, 8
    g, logits, q, proposals = _random_case(4, batch, k, vocab)
    num = torch.randint(0, k + 1, (batch,), generator=g)
    beyond = torch.arange(k)[None, :] >= num[:, None]
    outcomes = []
    for garbage in (float("nan"), 123.0):
        lg = logits.clone()
        lg[:, 1:][beyond] = garbage
        pr = proposals.masked_fill(beyond, -1 if garbage != garbage else vocab + 5)
        dq = q.clone()
        dq[beyond] = garbage
        res = verify(lg, pr, num, dq, torch.zeros(batch, dtype=torch.bool), [WARM] * batch,
                     torch.Generator().manual_seed(9))
        outcomes.append((res.num_accepted, res.bonus))
    assert torch.equal(outcomes[0][0], outcomes[1][0]) and torch.equal(outcomes[0][1], outcomes[1][1])
    assert (outcomes[0][0] <= num).all()


def test_outcomes_on_a_hand_built_batch():
    # Greedy rows, so every outcome is known in advance: p at (row, position) is one-hot on
    # chain[row, position]; a proposal is accepted while it equals that token.
    vocab = 5
    chain = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0], [4, 3, 2, 1], [2, 2, 2, 2], [3, 1, 4, 1]])
    logits = 5.0 * torch.nn.functional.one_hot(chain, vocab).float()
    proposals = torch.tensor([
        [1, 2, 3],  # all 3 right              -> 3 accepted, bonus chain[0, 3] = 4
        [0, 1, 0],  # wrong at position 1      -> 1 accepted, bonus chain[1, 1] = 0
        [4, 3, 0],  # 2 proposals, both right  -> 2 accepted, bonus chain[2, 2] = 2
        [0, 0, 0],  # no proposals             -> 0 accepted, bonus chain[3, 0] = 2
        [0, 1, 4],  # wrong at position 0      -> 0 accepted, bonus chain[4, 0] = 3
    ])
    num = torch.tensor([3, 3, 2, 0, 3])
    res = verify(logits, proposals, num, None, torch.ones(5, dtype=torch.bool), [GREEDY] * 5, None)
    assert res.num_accepted.tolist() == [3, 1, 2, 0, 0]
    assert res.bonus.tolist() == [4, 0, 2, 2, 3]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    batch, k, vocab = 50, 3, 8
    _, logits, q, proposals = _random_case(6, batch, k, vocab)
    num = torch.full((batch,), k)
    params = [SamplingParams(seed=100 + i) for i in range(batch)]
    full = verify(logits, proposals, num, q, torch.zeros(batch, dtype=torch.bool), params,
                  [make_generator(p) for p in params])
    sub = [3, 17, 41]
    part = verify(logits[sub], proposals[sub], num[sub], q[sub], torch.zeros(3, dtype=torch.bool),
                  [params[i] for i in sub], [make_generator(params[i]) for i in sub])
    assert torch.equal(full.num_accepted[sub], part.num_accepted)
    assert torch.equal(full.bonus[sub], part.bonus)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=3),
                                    SamplingParams(temperature=1.1, top_p=0.7, min_p=0.1)],
                         ids=["top-k", "top-p+min-p"])
def test_point_mass_proposals_against_a_truncated_target(params):
    """Fast-backup proposals (q = delta_s) for every token s, inside and outside the truncated
    target's support: s is accepted with probability p(s) (never when p(s) = 0), the bonus after a
    rejection follows p with s removed and renormalised, the first emitted token follows p, and
    the bonus after an acceptance follows p at the next position."""
    vocab, per_token = 8, 20_000
    g = torch.Generator().manual_seed(7)
    logits = 2 * torch.randn(2, vocab, generator=g)  # position 0, then the position after s
    p = processed_probs(logits, [params] * 2).double()
    assert 0 < int((p[0] > 0).sum()) < vocab, "the truncation should remove some tokens"
    batch = vocab * per_token
    s = torch.arange(vocab).repeat_interleave(per_token)
    res = verify(logits.expand(batch, -1, -1), s[:, None], torch.ones(batch, dtype=torch.long), None,
                 torch.ones(batch, dtype=torch.bool), [params] * batch, g)
    accepted = res.num_accepted == 1
    first = torch.where(accepted, s, res.bonus)
    assert (p[0][first] > 0).all()
    parts = [("bonus after an acceptance", res.bonus[accepted], p[1])]
    for token in range(vocab):
        mine = s == token
        rejected = mine & ~accepted
        if p[0, token] == 0:
            assert not accepted[mine].any(), f"token {token} has p = 0 and was accepted"
        assert not (res.bonus[rejected] == token).any(), f"rejected token {token} came back as the bonus"
        rest = p[0].clone()
        rest[token] = 0
        parts += [(f"accepted, s = {token}", accepted[mine].long(), torch.stack([1 - p[0, token], p[0, token]])),
                  (f"bonus after rejecting {token}", res.bonus[rejected], rest / rest.sum()),
                  (f"first token, s = {token}", first[mine], p[0])]
    check = check_counts(parts)
    assert check.ok, check


def test_q_rows_the_proposals_were_not_drawn_from_are_refused():
    # The proposals come from q, but the rows given to verify are q cut to its top 2 (the shipped
    # rows drifted from the sampled ones). Wherever a proposal has no mass there, verify must
    # refuse rather than accept with a ratio against the wrong q. (A drift that keeps every
    # proposal's mass positive is caught statistically: test_exactness.py's shifted-q control.)
    batch, k, vocab = 200, 3, 8
    g, logits, q, proposals = _random_case(8, batch, k, vocab)
    shipped = processed_probs(q.log(), [SamplingParams(top_k=2)] * batch)
    assert (shipped.gather(-1, proposals[..., None]) == 0).any()
    num = torch.full((batch,), k)
    ratio_rows = torch.zeros(batch, dtype=torch.bool)
    verify(logits, proposals, num, q, ratio_rows, [WARM] * batch, g)  # the rows they came from
    with pytest.raises(ValueError, match="probability 0"):
        verify(logits, proposals, num, shipped, ratio_rows, [WARM] * batch, g)


def test_zero_residual_falls_back_to_p():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    q = p[:, :1].clone()  # residual (p - q)+ is all zero
    dist = _bonus_distribution(p, q, torch.tensor([[0]]), torch.tensor([0]), torch.tensor([1]),
                               torch.tensor([False]))
    assert torch.equal(dist, p[:, 0])


def test_zero_proposals():
    logits = torch.randn(3, 1, 5)
    res = verify(logits, torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long), None,
                 torch.ones(3, dtype=torch.bool), [GREEDY] * 3, None)
    assert torch.equal(res.bonus, logits[:, 0].argmax(-1)) and (res.num_accepted == 0).all()


def _args(batch=4, k=2, vocab=5):
    return dict(target_logits=torch.randn(batch, k + 1, vocab),
                proposals=torch.zeros(batch, k, dtype=torch.long),
                num_proposals=torch.full((batch,), k), draft_probs=torch.full((batch, k, vocab), 1 / vocab),
                point_mass=torch.zeros(batch, dtype=torch.bool), params=[WARM] * batch, generators=None)


@pytest.mark.parametrize("change, message", [
    (dict(target_logits=torch.randn(4, 5)), "target_logits"),
    (dict(proposals=torch.zeros(4, 3, dtype=torch.long)), "proposals"),
    (dict(proposals=torch.zeros(4, 2, dtype=torch.int32)), "proposals"),
    (dict(proposals=torch.full((4, 2), 5)), "proposals"),
    (dict(num_proposals=torch.full((4,), 3)), "num_proposals"),
    (dict(num_proposals=torch.full((4,), -1)), "num_proposals"),
    (dict(point_mass=torch.zeros(4)), "point_mass"),
    (dict(draft_probs=torch.rand(4, 2, 6)), "draft_probs"),
    (dict(draft_probs=None), "draft_probs"),
    (dict(draft_probs=torch.zeros(4, 2, 5)), "probability 0"),
    (dict(params=[WARM] * 3), "params"),
    (dict(generators=[None] * 3), "generators"),
])
def test_bad_input_is_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        verify(**{**_args(), **change})
