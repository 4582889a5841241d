"""Statistical exactness of speculative verification (ALGORITHM.md section 5).

Setting: a Markov "language" over a small vocabulary. The target's next-token logits depend only
on the previous token (table [V, V]); so does the draft's distribution. Speculative rounds are
simulated for N independent rows starting from the same context token, so the first two emitted
tokens must follow exactly P(x1, x2) = p(x1 | x0) p(x2 | x1) with p the target's processed
distribution (plain autoregressive sampling). Rows that accept nothing in round 1 emit their
second token in round 2, which is simulated too.

The checker compares empirical frequencies with the exact probabilities cell by cell in units of
the binomial standard deviation. With N = 100k a bias of 0.01 in any cell is >= 6 sigma (checked
below by test_checker_detects_a_bias_of_0_01) while the pass limit is 4.5 sigma; seeds are fixed.
p (processed_probs) is checked against an independent implementation in test_sampling.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from trtssd.sampling import SamplingParams, processed_probs, sample
from trtssd.spec_decode.saguaro import saguaro_probs
from trtssd.spec_decode.verify import VerifyResult, verify

N = 100_000
V = 6
Z_LIMIT = 4.5
X0 = 0  # the context token every row starts from


@dataclass(frozen=True)
class DistCheck:
    max_z: float
    worst_cell: int
    impossible_hits: int  # samples in cells of probability 0

    @property
    def ok(self) -> bool:
        return self.max_z < Z_LIMIT and self.impossible_hits == 0


def check_distribution(samples: torch.Tensor, expected: torch.Tensor) -> DistCheck:
    """Max over cells of |frequency - p| / sqrt(p (1 - p) / n)."""
    expected = expected.double().reshape(-1)
    n = samples.numel()
    counts = torch.bincount(samples.reshape(-1), minlength=expected.numel()).double()
    freq = counts / n
    possible = expected > 0
    sigma = torch.sqrt(expected * (1 - expected) / n).clamp(min=1e-12)
    z = torch.where(possible, (freq - expected).abs() / sigma, torch.zeros_like(freq))
    return DistCheck(float(z.max()), int(z.argmax()), int(counts[~possible].sum()))


def assert_exact(samples: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    result = check_distribution(samples, expected)
    assert result.ok, f"{what}: {result} (limit {Z_LIMIT} sigma)"


# ---- the Markov world -------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    target_logits: torch.Tensor  # [V, V] logits of x_t given x_{t-1}
    target_params: SamplingParams
    draft_q: torch.Tensor  # [V, V] draft distribution of x_t given x_{t-1}
    k: int
    mode: str = "ratio"  # ratio | random (point mass) | greedy_draft (point mass) | mixed
    saguaro_c: float = 1.0
    saguaro_fanout: tuple[int, ...] = ()  # F_0..F_{K-1} used to build q' per depth

    def target_table(self) -> torch.Tensor:
        return processed_probs(self.target_logits[None], [self.target_params])[0]

    def expected_joint(self) -> torch.Tensor:
        p = self.target_table()
        return p[X0][:, None] * p  # [x1, x2]


def make_world(seed: int, k: int, temperature: float = 1.0, draft_noise: float = 0.8, **kw) -> World:
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(V, V, generator=g)
    draft_logits = target_logits + draft_noise * torch.randn(V, V, generator=g)
    draft_q = torch.softmax(draft_logits / max(temperature, 1e-3), dim=-1)
    params = kw.pop("target_params", SamplingParams(temperature=temperature))
    return World(target_logits, params, draft_q, k, **kw)


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [n, K]
    q: torch.Tensor  # [n, K, V] distribution each token was drawn from (ratio rows)
    point_mass: torch.Tensor  # [n] bool


def propose(world: World, context: torch.Tensor, g: torch.Generator) -> Proposal:
    n = context.numel()
    mode = world.mode
    if mode == "mixed":  # every row picks its own kind of draft
        kinds = torch.randint(0, 3, (n,), generator=g)
    else:
        kinds = torch.full((n,), ["ratio", "random", "greedy_draft"].index(mode))
    tokens, qs = [], []
    prev = context
    for depth in range(world.k):
        q = world.draft_q[prev]
        if world.saguaro_c < 1:
            q = saguaro_probs(q, world.saguaro_fanout[depth], world.saguaro_c)
        sampled = sample(q, g)
        random = torch.randint(0, V, (n,), generator=g)
        greedy = q.argmax(dim=-1)
        token = torch.where(kinds == 0, sampled, torch.where(kinds == 1, random, greedy))
        tokens.append(token)
        qs.append(q)
        prev = token
    return Proposal(torch.stack(tokens, 1), torch.stack(qs, 1), kinds != 0)


VerifyFn = Callable[..., VerifyResult]


def run_round(world: World, context: torch.Tensor, g: torch.Generator, verify_fn: VerifyFn = verify,
              num_proposals: torch.Tensor | None = None, draft_probs_override=None):
    """One speculative round per row -> (emitted tokens [n, K+1], number emitted [n])."""
    n = context.numel()
    prop = propose(world, context, g)
    if num_proposals is None:
        num_proposals = torch.full((n,), world.k, dtype=torch.long)
    valid = torch.arange(world.k)[None, :] < num_proposals[:, None]
    prevs = torch.cat([context[:, None], prop.tokens], dim=1)  # token before each target row
    logits = world.target_logits[prevs]  # [n, K+1, V]
    # Positions past a row's proposals hold garbage the verifier must ignore.
    logits = torch.where(torch.cat([torch.ones(n, 1, dtype=torch.bool), valid], 1)[..., None],
                         logits, torch.full_like(logits, float("nan")))
    tokens = torch.where(valid, prop.tokens, torch.full_like(prop.tokens, -7))
    draft_probs = prop.q if draft_probs_override is None else draft_probs_override(context, prop)
    res = verify_fn(logits, tokens, num_proposals, draft_probs, prop.point_mass,
                    [world.target_params] * n, g)
    emitted = torch.cat([prop.tokens, torch.zeros(n, 1, dtype=torch.long)], dim=1)
    emitted[torch.arange(n), res.num_accepted] = res.bonus
    return emitted, res.num_emitted


def first_two_tokens(world: World, seed: int, verify_fn: VerifyFn = verify, variable_k: bool = False,
                     draft_probs_override=None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    context = torch.full((N,), X0, dtype=torch.long)

    def num_proposals(n):
        return torch.randint(0, world.k + 1, (n,), generator=g) if variable_k else None

    emitted, count = run_round(world, context, g, verify_fn, num_proposals(N), draft_probs_override)
    x1, x2 = emitted[:, 0], emitted[:, 1].clone()
    again = count == 1  # only the bonus came out: the second token is round 2's first
    if bool(again.any()):
        more, _ = run_round(world, x1[again], g, verify_fn, num_proposals(int(again.sum())),
                            draft_probs_override)
        x2[again] = more[:, 0]
    return x1, x2


def assert_world_exact(world: World, seed: int, **kw) -> None:
    x1, x2 = first_two_tokens(world, seed, **kw)
    joint = world.expected_joint()
    assert_exact(x1, joint.sum(1), "first token")
    assert_exact(x2, joint.sum(0), "second token")
    assert_exact(x1 * V + x2, joint, "joint of the first two tokens")


def world_is_biased(world: World, seed: int, **kw) -> bool:
    x1, x2 = first_two_tokens(world, seed, **kw)
    joint = world.expected_joint()
    return not (check_distribution(x1, joint.sum(1)).ok and check_distribution(x1 * V + x2, joint).ok)


# ---- the checker has power --------------------------------------------------------------------


def test_checker_detects_a_bias_of_0_01():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(V, generator=g), -1).double()
    assert check_distribution(torch.multinomial(p, N, replacement=True, generator=g), p).ok
    for token in range(V):
        donor = (token + 1) % V
        biased = p.clone()
        biased[token] += 0.01
        biased[donor] -= 0.01
        samples = torch.multinomial(biased, N, replacement=True, generator=g)
        assert not check_distribution(samples, p).ok, f"a +0.01 bias on token {token} went unnoticed"


# ---- exact cases --------------------------------------------------------------------------------


def test_ordinary_speculative_sampling_k1():
    assert_world_exact(make_world(seed=10, k=1, temperature=1.0), seed=11)


def test_ordinary_speculative_sampling_k4_joint_of_first_two_tokens():
    assert_world_exact(make_world(seed=12, k=4, temperature=0.8), seed=13)


@pytest.mark.parametrize("mode", ["random", "greedy_draft"])
def test_point_mass_proposals_at_positive_temperature(mode):
    assert_world_exact(make_world(seed=14, k=3, temperature=0.7, mode=mode), seed=15)


@pytest.mark.parametrize("c", [0.3, 0.7])
def test_saguaro_q_prime(c):
    world = make_world(seed=16, k=3, temperature=1.0, saguaro_c=c, saguaro_fanout=(2, 1, 0))
    assert_world_exact(world, seed=17)


@pytest.mark.parametrize("target_params", [SamplingParams(temperature=0.9, top_k=3),
                                           SamplingParams(temperature=1.2, top_p=0.7),
                                           SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.1)])
def test_target_with_truncation(target_params):
    world = make_world(seed=18, k=3, target_params=target_params)
    assert (world.target_table() == 0).any(), "the truncation should remove some tokens"
    assert_world_exact(world, seed=19)


def test_truncated_draft_against_full_target():
    world = make_world(seed=20, k=3)
    q = processed_probs(torch.log(world.draft_q)[None], [SamplingParams(top_k=2)])[0]
    assert_world_exact(World(world.target_logits, world.target_params, q, k=3), seed=21)


def test_mixed_batch_of_ratio_random_and_greedy_draft_rows():
    assert_world_exact(make_world(seed=22, k=3, temperature=0.9, mode="mixed"), seed=23)


def test_rows_with_different_numbers_of_proposals():
    assert_world_exact(make_world(seed=24, k=4, mode="mixed"), seed=25, variable_k=True)


# ---- negative controls: the same checker must fail on known-biased rules -----------------------


def reference_argmax_rule(logits, proposals, num_proposals, draft_probs, point_mass, params, generators):
    """The SSD reference's fast-backup rule at T > 0: accept a random proposal only if it equals
    argmax p; on the first mismatch sample the bonus from p."""
    p = processed_probs(logits, params)
    k = proposals.shape[1]
    valid = torch.arange(k)[None, :] < num_proposals[:, None]
    match = (proposals == p[:, :k].argmax(-1)) & valid
    num_accepted = match.long().cumprod(-1).sum(-1)
    bonus = sample(p[torch.arange(len(p)), num_accepted], generators)
    accepted = torch.arange(k)[None, :] < num_accepted[:, None]
    return VerifyResult(num_accepted, bonus, accepted, num_proposals)


def test_negative_control_reference_argmax_rule_is_detected():
    world = make_world(seed=14, k=3, temperature=0.7, mode="random")
    assert_world_exact(world, seed=15)  # the exact rule passes on this very world ...
    assert world_is_biased(world, seed=15, verify_fn=reference_argmax_rule)  # ... the reference's fails


def test_negative_control_verifying_saguaro_tokens_with_plain_q_is_detected():
    world = make_world(seed=16, k=3, saguaro_c=0.3, saguaro_fanout=(2, 1, 0))
    plain_q = lambda context, prop: world.draft_q[torch.cat([context[:, None], prop.tokens[:, :-1]], 1)]
    assert world_is_biased(world, seed=17, draft_probs_override=plain_q)
