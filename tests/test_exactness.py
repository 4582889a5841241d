"""Statistical exactness of speculative verification (docs/algorithm.md section 5).

Every test simulates speculative decoding on a Markov chain until each of N rows has K + 1 tokens
(tests/exact_chain.py: rounds of "draft K proposals from the last token, verify, emit") and checks
the marginal of every position 1..K+1 and the joint of every pair (x_t, x_{t+1}) against the exact
answer of plain autoregressive sampling, computed by enumeration. The per-check false-alarm
probability is <= 1e-5 and a 0.01 shift of any cell is caught with probability >= 0.99 (see
exact_chain.py; test_checker_detects_a_shift_of_0_01 checks the power). Seeds are fixed.

The negative controls at the end run the same checks on rules known to be wrong (mutants of
verify, the SSD reference's fast-backup rule, q rows other than those the tokens were drawn from)
and assert that they fail. p (processed_probs) is checked against an independent implementation
in test_sampling.py.
"""

from __future__ import annotations

import pytest
import torch

from exact_chain import (MUTANTS, N, V, X0, Chain, Group, check_chain, check_counts, exact_tables,
                         make_chain, run_and_check)
from trtssd.sampling import SamplingParams, processed_probs, sample
from trtssd.spec_decode.verify import VerifyResult

SP = SamplingParams
CHAIN_K1 = make_chain(seed=10, k=1)
CHAIN_K3 = make_chain(seed=14, k=3)
CHAIN_K4 = make_chain(seed=12, k=4)
RATIO_K4 = [Group(SP(temperature=0.8))]
ARGMAX_K3 = [Group(SP(temperature=0.7), draft="argmax")]
RANDOM_K3 = [Group(SP(temperature=0.7), draft="random")]
SAGUARO_K3 = [Group(SP(), draft="saguaro", saguaro_c=0.3, saguaro_fanout=(2, 1, 0))]


def assert_exact(chain: Chain, groups: list[Group], seed: int, **kw) -> None:
    checks = run_and_check(chain, groups, seed, **kw)
    for group, check in zip(groups, checks):
        assert check.ok, f"{group.draft} rows with {group.params}: {check}"


def assert_detected(chain: Chain, groups: list[Group], seed: int, **kw) -> None:
    checks = run_and_check(chain, groups, seed, **kw)
    assert not any(check.ok for check in checks), f"a biased rule passed: {checks}"


# ---- the yardstick: exact tables and the checker ------------------------------------------------


def test_exact_tables_agree_with_matrix_powers():
    table = CHAIN_K4.target_table(SP(temperature=0.9, top_k=4)).double()
    exact = exact_tables(table, 5)
    dist = torch.zeros(V, dtype=torch.float64)
    dist[X0] = 1.0
    for t in range(5):
        dist = dist @ table  # marginal of x_{t+1}
        assert torch.allclose(exact.marginals[t], dist, atol=1e-12)
        if t < 4:
            assert torch.allclose(exact.pairs[t], (dist[:, None] * table).reshape(-1), atol=1e-12)


def test_plain_autoregressive_sampling_passes_the_check():
    # The null case through a path that shares nothing with verify: one token at a time.
    table = CHAIN_K4.target_table(SP(temperature=0.8, top_p=0.9))
    g = torch.Generator().manual_seed(2)
    x = torch.full((N,), X0)
    tokens = []
    for _ in range(5):
        x = torch.multinomial(table[x], 1, generator=g)[:, 0]
        tokens.append(x)
    check = check_chain(torch.stack(tokens, 1), exact_tables(table, 5))
    assert check.ok, check


def test_checker_detects_a_shift_of_0_01():
    # One distribution checked as part of a family as large as a K = 4 chain check (174 cells);
    # a cell of probability 0.5 is the hardest place to see a shift (largest variance).
    family = 5 * V + 4 * V * V
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    assert check_counts([("x", torch.multinomial(p, N, replacement=True, generator=g), p)], family).ok
    for a in range(V):
        for b in range(V):
            if a == b or p[a] < 0.01:
                continue
            shifted = p.clone()
            shifted[a] -= 0.01
            shifted[b] += 0.01
            samples = torch.multinomial(shifted, N, replacement=True, generator=g)
            assert not check_counts([("x", samples, p)], family).ok, f"0.01 moved from {a} to {b}"


# ---- exact cases --------------------------------------------------------------------------------


def test_ratio_rows_k1():
    assert_exact(CHAIN_K1, [Group(SP())], seed=11)


def test_ratio_rows_k4_every_position_and_pair():
    assert_exact(CHAIN_K4, RATIO_K4, seed=13)


@pytest.mark.parametrize("groups", [RANDOM_K3, ARGMAX_K3, [Group(SP(temperature=0.7), draft="ngram")]],
                         ids=["random", "argmax", "ngram"])
def test_point_mass_proposals_at_positive_temperature(groups):
    assert_exact(CHAIN_K3, groups, seed=15)


@pytest.mark.parametrize("c", [0.3, 0.7])
def test_saguaro_q_prime(c):
    assert_exact(CHAIN_K3, [Group(SP(), draft="saguaro", saguaro_c=c, saguaro_fanout=(2, 1, 0))], seed=17)


TRUNCATED = [
    (SP(temperature=0.9, top_k=3), "q"),
    (SP(temperature=1.2, top_p=0.7), "q"),
    (SP(temperature=1.0, top_k=4, top_p=0.8, min_p=0.1), "q"),
    # Point-mass (fast backup) proposals, which may lie outside the truncated target's support.
    (SP(temperature=0.9, top_k=3), "ngram"),
    (SP(temperature=1.0, top_p=0.8, min_p=0.1), "argmax"),
    (SP(temperature=1.0, top_p=0.8, min_p=0.1), "random"),
]


@pytest.mark.parametrize("params, draft", TRUNCATED, ids=[f"{d}-{i}" for i, (_, d) in enumerate(TRUNCATED)])
def test_truncated_target(params, draft):
    assert (CHAIN_K3.target_table(params) == 0).any(), "the truncation should remove some tokens"
    assert_exact(CHAIN_K3, [Group(params, draft=draft)], seed=19)


def test_truncated_draft_against_full_target():
    assert_exact(CHAIN_K3, [Group(SP(), draft_params=SP(top_k=2))], seed=21)


def test_mixed_batch_of_every_kind_of_row():
    # One verify call per round for all of them; each group is checked against its own target.
    # The groups are smaller than N (less power); each kind is checked at full power above.
    rows = N // 3
    groups = [
        Group(SP(temperature=0.9), rows=rows),
        Group(SP(temperature=0.9, top_k=4, min_p=0.05), draft="saguaro", rows=rows, saguaro_c=0.5,
              saguaro_fanout=(1, 1, 0)),
        Group(SP(temperature=0.9, top_p=0.8), draft="random", rows=rows),
        Group(SP(temperature=0.6), draft="argmax", rows=rows),
        # Greedy rows: all output is the target's argmax chain, whatever was drafted.
        Group(SP(temperature=0.0), rows=2000),  # the draft's greedy q (its argmax)
        Group(SP(temperature=0.0), draft_params=SP(), rows=2000),  # sampled from a warm q
        Group(SP(temperature=0.0), draft="ngram", rows=2000),
    ]
    assert_exact(CHAIN_K3, groups, seed=23)


def test_rows_with_different_numbers_of_proposals():
    groups = [Group(SP(temperature=0.9), rows=N // 2), Group(SP(temperature=0.9), draft="ngram", rows=N // 2)]
    assert_exact(CHAIN_K4, groups, seed=25, variable_k=True)


def test_proposals_verified_chosen_from_past_outcomes():
    """K per round: how many proposals a round verifies depends on earlier rounds' outcomes."""
    groups = [Group(SP(temperature=0.9), rows=N // 2), Group(SP(temperature=0.9), draft="saguaro", saguaro_c=0.3,
                                                              saguaro_fanout=(2, 1, 1, 0, 0), rows=N // 2)]
    assert_exact(CHAIN_K4, groups, seed=27, k_from_history=True)


# ---- negative controls: the same checks must fail on known-biased rules ---------------------------


@pytest.mark.parametrize("mutant", list(MUTANTS))
@pytest.mark.parametrize("chain, groups, seed", [(CHAIN_K4, RATIO_K4, 13), (CHAIN_K3, ARGMAX_K3, 15)],
                         ids=["ratio", "point-mass"])
def test_verify_mutant_is_detected(mutant, chain, groups, seed):
    # The same chain, rows and seed pass with the real verify (tests above).
    assert_detected(chain, groups, seed, verify_fn=MUTANTS[mutant])


def reference_argmax_rule(logits, proposals, num_proposals, draft_probs, point_mass, params, generators):
    """The SSD reference's fast-backup rule at T > 0: accept a random proposal only if it equals
    argmax p; on the first mismatch sample the bonus from p."""
    p = processed_probs(logits, params)
    k = proposals.shape[1]
    valid = torch.arange(k)[None, :] < num_proposals[:, None]
    match = (proposals == p[:, :k].argmax(-1)) & valid
    num_accepted = match.long().cumprod(-1).sum(-1)
    bonus = sample(p[torch.arange(len(p)), num_accepted], generators)
    return VerifyResult(num_accepted, bonus)


def test_reference_argmax_rule_is_detected():
    assert_detected(CHAIN_K3, RANDOM_K3, seed=15, verify_fn=reference_argmax_rule)


def test_saguaro_tokens_verified_with_plain_q_are_detected():
    # Tokens drawn from q' but verified with q: the drift docs/algorithm.md section 5 warns about.
    assert_detected(CHAIN_K3, SAGUARO_K3, seed=17, draft_probs_fn=lambda prop: prop.plain_q)


def test_q_rows_shifted_by_one_depth_are_detected():
    # Proposal i verified with the q row of proposal i + 1 (an off-by-one in the shipped rows).
    def shifted(prop):
        return torch.cat([prop.q[:, 1:], prop.q[:, -1:]], dim=1)

    assert_detected(CHAIN_K4, RATIO_K4, seed=13, draft_probs_fn=shifted)
