"""Speculative decoding on a Markov chain, with the exact answer (docs/algorithm.md section 5).

The "language" is a Markov chain over V tokens: the target's logits for the next token depend only
on the previous token (a [V, V] table), and so do the draft's. Plain autoregressive sampling from
the target's processed distribution P (``processed_probs`` of those logits) therefore emits
x_1, x_2, ... from the fixed context x_0 with probability prod_t P[x_{t-1}, x_t].

:func:`simulate` runs speculative decoding the way the runtime does: every round drafts a chain of
K proposals from the row's last emitted token, verifies all rows with one batched ``verify`` call,
appends the accepted proposals and the bonus, and repeats until every row has K + 1 tokens. Every
position 1..K+1 thus gets one sample per row, whatever the acceptance pattern was.

:func:`exact_tables` computes the marginals of x_1..x_{K+1} and the joints of (x_t, x_{t+1}) by
summing the product above over all V^(K+1) sequences (test_exactness.py checks it against matrix
powers), and :func:`check_counts` compares simulated counts with them cell by cell.

The statistics: each cell's count is Binomial(n, p) under exactness. A check fails when some cell's
exact two-sided binomial tail probability is below ALPHA / (number of cells of the check), so a
correct implementation fails one check with probability <= ALPHA = 1e-5 (Bonferroni; no normal
approximation, so cells of tiny probability are not a source of false alarms). That per-cell limit
is ~5.4 sigma for well-populated cells. With N = 150k rows a shift of 0.01 in any cell's
probability is >= 0.01 / sqrt(0.25 / N) = 7.7 sigma, caught with probability >= 0.99 per cell
(tests/test_exactness.py::test_checker_detects_a_shift_of_0_01 checks this empirically).
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import numpy as np
import torch
from scipy.stats import binom

from trtssd.sampling import SamplingParams, processed_probs, sample
from trtssd.spec_decode.saguaro import saguaro_probs
from trtssd.spec_decode.verify import VerifyResult, verify

# The module itself, for patching (its name is shadowed by the function imported above).
verify_module = importlib.import_module("trtssd.spec_decode.verify")

V = 6
X0 = 0  # the context token every row starts from
N = 150_000
ALPHA = 1e-5

# How a group's proposals are made:
#   q        sampled from the draft's q                       ratio rows, verified with q
#   saguaro  sampled from q' = saguaro_probs(q, F_j, c)        ratio rows, verified with q'
#   argmax   the draft's argmax (a greedy draft at T > 0)      point-mass rows (verify ignores q)
#   ngram    NGRAM[previous token], a fixed guess             point-mass rows
#   random   a uniformly random token                         point-mass rows
DRAFTS = ("q", "saguaro", "argmax", "ngram", "random")
NGRAM = torch.tensor([(3 * t + 1) % V for t in range(V)])  # a fixed "n-gram" guess per previous token


@dataclass(frozen=True)
class Chain:
    target_logits: torch.Tensor  # [V, V]: row a = logits of the next token after token a
    draft_logits: torch.Tensor  # [V, V]
    k: int  # proposals per round

    def target_table(self, params: SamplingParams) -> torch.Tensor:
        """[V, V] the processed target distribution P of the next token given the previous."""
        return processed_probs(self.target_logits[None], [params])[0]


def make_chain(seed: int, k: int, draft_noise: float = 0.8) -> Chain:
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(V, V, generator=g)
    draft_logits = target_logits + draft_noise * torch.randn(V, V, generator=g)
    return Chain(target_logits, draft_logits, k)


@dataclass(frozen=True)
class Group:
    """Rows that share the target's sampling settings and the way their proposals are made."""

    params: SamplingParams  # the request's sampling (target p; also the draft's q unless draft_params)
    draft: str = "q"  # one of DRAFTS
    rows: int = N
    draft_params: SamplingParams | None = None  # the draft processes its logits with these instead
    saguaro_c: float = 1.0  # draft == "saguaro": q' = saguaro_probs(q, F_j, c) at depth j
    saguaro_fanout: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.draft in DRAFTS, self.draft


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [n, K]
    q: torch.Tensor  # [n, K, V] the rows each token was drawn from (q or q')
    plain_q: torch.Tensor  # [n, K, V] the draft's q before any Saguaro scaling
    point_mass: torch.Tensor  # [n] bool


VerifyFn = Callable[..., VerifyResult]
DraftProbsFn = Callable[[Proposal], torch.Tensor]  # which rows verify is given as draft_probs


@dataclass(frozen=True)
class _Batch:
    """The simulated batch: the groups' rows one after the other."""

    groups: list[Group]
    group: torch.Tensor  # [rows] group index of each row
    params: list[SamplingParams]  # one per row
    q_tables: torch.Tensor  # [G, V, V] each group's draft distribution q of the next token


def _make_batch(chain: Chain, groups: list[Group]) -> _Batch:
    return _Batch(
        groups=groups,
        group=torch.cat([torch.full((gr.rows,), i) for i, gr in enumerate(groups)]),
        params=[gr.params for gr in groups for _ in range(gr.rows)],
        q_tables=torch.stack([processed_probs(chain.draft_logits[None], [gr.draft_params or gr.params])[0]
                              for gr in groups]),
    )


def _propose(chain: Chain, rows: _Batch, active: torch.Tensor, last: torch.Tensor,
             g: torch.Generator) -> Proposal:
    """K proposals per active row from its last token, each group's own way."""
    group = rows.group[active]
    n = len(active)
    tokens, qs, plain_qs = [], [], []
    prev = last
    for depth in range(chain.k):
        plain = rows.q_tables[group, prev]  # [n, V]
        q = plain.clone()
        for i, gr in enumerate(rows.groups):
            if gr.draft == "saguaro":
                mine = group == i
                q[mine] = saguaro_probs(plain[mine], gr.saguaro_fanout[depth], gr.saguaro_c)
        sampled = sample(q, g)
        random = torch.randint(0, V, (n,), generator=g)
        token = sampled.clone()
        for i, gr in enumerate(rows.groups):
            mine = group == i
            if gr.draft == "argmax":
                token[mine] = plain[mine].argmax(-1)
            elif gr.draft == "ngram":
                token[mine] = NGRAM[prev[mine]]
            elif gr.draft == "random":
                token[mine] = random[mine]
        tokens.append(token)
        qs.append(q)
        plain_qs.append(plain)
        prev = token
    point_kinds = torch.tensor([gr.draft in ("argmax", "ngram", "random") for gr in rows.groups])
    return Proposal(torch.stack(tokens, 1), torch.stack(qs, 1), torch.stack(plain_qs, 1),
                    point_kinds[group])


def simulate(chain: Chain, groups: list[Group], seed: int, verify_fn: VerifyFn = verify,
             draft_probs_fn: DraftProbsFn | None = None, variable_k: bool = False,
             k_from_history: bool = False) -> list[torch.Tensor]:
    """Speculative decoding of every row until it has K + 1 tokens -> per group [rows, K+1].
    ``k_from_history``: each row verifies a number of proposals chosen from its past outcomes,
    as K per round chooses from live acceptance (runtime/k_per_round.py)."""
    g = torch.Generator().manual_seed(seed)
    k = chain.k
    rows = _make_batch(chain, groups)
    total = len(rows.params)
    out = torch.full((total, k + 1), -1, dtype=torch.long)
    produced = torch.zeros(total, dtype=torch.long)
    last = torch.full((total,), X0, dtype=torch.long)
    last_accepted = torch.zeros(total, dtype=torch.long)
    while bool((produced < k + 1).any()):
        active = torch.nonzero(produced < k + 1)[:, 0]
        n = len(active)
        prop = _propose(chain, rows, active, last[active], g)
        if variable_k:  # the runtime may propose fewer than K (a shorter chain, a budget)
            num = torch.randint(0, k + 1, (n,), generator=g)
        elif k_from_history:  # more after a round that accepted more, fewer after rejections
            num = torch.clamp(last_accepted[active] + (last[active] % 2), 1, k)
        else:
            num = torch.full((n,), k, dtype=torch.long)
        valid = torch.arange(k)[None, :] < num[:, None]
        prevs = torch.cat([last[active, None], prop.tokens], dim=1)  # the token before each target row
        logits = chain.target_logits[prevs]  # [n, K+1, V]
        # Positions past a row's proposals hold garbage the verifier must ignore.
        scored = torch.cat([torch.ones(n, 1, dtype=torch.bool), valid], dim=1)
        logits = torch.where(scored[..., None], logits, torch.full_like(logits, float("nan")))
        proposals = torch.where(valid, prop.tokens, torch.full_like(prop.tokens, -7))
        draft_probs = prop.q if draft_probs_fn is None else draft_probs_fn(prop)
        res = verify_fn(logits, proposals, num, draft_probs, prop.point_mass,
                        [rows.params[i] for i in active.tolist()], g)
        # Row emits its accepted proposals then the bonus; keep what fits in K + 1 positions.
        emitted = torch.cat([prop.tokens, torch.zeros(n, 1, dtype=torch.long)], dim=1)
        emitted[torch.arange(n), res.num_accepted] = res.bonus
        for j in range(k + 1):
            pos = produced[active] + j
            keep = (j <= res.num_accepted) & (pos <= k)
            out[active[keep], pos[keep]] = emitted[keep, j]
        produced[active] += res.num_accepted + 1
        last[active] = res.bonus
        last_accepted[active] = res.num_accepted
    assert bool((out >= 0).all()), "the simulation left a position unfilled"
    return list(torch.split(out, [gr.rows for gr in groups]))


# ---- the exact answer -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExactTables:
    marginals: torch.Tensor  # [K+1, V] float64: P(x_t = a), t = 1..K+1
    pairs: torch.Tensor  # [K, V*V] float64: P(x_t = a, x_{t+1} = b) at index a*V + b, t = 1..K


def exact_tables(table: torch.Tensor, length: int) -> ExactTables:
    """Distributions of x_1..x_length of the chain with transition table [V, V], by enumeration:
    every sequence's probability prod_t table[x_{t-1}, x_t] summed into the cells it falls in."""
    table = table.double()
    seqs = torch.tensor(list(itertools.product(range(V), repeat=length)))  # [V^length, length]
    prevs = torch.cat([torch.full((len(seqs), 1), X0), seqs[:, :-1]], dim=1)
    prob = table[prevs, seqs].prod(dim=1)  # [V^length]
    marginals = torch.zeros(length, V, dtype=torch.float64)
    pairs = torch.zeros(length - 1, V * V, dtype=torch.float64)
    for t in range(length):
        marginals[t].index_add_(0, seqs[:, t], prob)
    for t in range(length - 1):
        pairs[t].index_add_(0, seqs[:, t] * V + seqs[:, t + 1], prob)
    return ExactTables(marginals, pairs)


# ---- the statistics ---------------------------------------------------------------------------------


def binomial_p_values(counts: np.ndarray, n: int, probs: np.ndarray) -> np.ndarray:
    """Two-sided exact tail probability of each count under Binomial(n, p): 2 min(P(X <= c), P(X >= c)).

    A count in a cell of probability 0 (or n - count in a cell of probability 1) gets 0.
    """
    low = binom.cdf(counts, n, probs)
    high = binom.sf(counts - 1, n, probs)
    return np.minimum(1.0, 2 * np.minimum(low, high))


@dataclass(frozen=True)
class Check:
    ok: bool
    worst: str  # the least likely cell, for the failure message
    min_p_value: float
    limit: float  # per-cell limit ALPHA / cells


def check_counts(parts: list[tuple[str, torch.Tensor, torch.Tensor]], family: int | None = None) -> Check:
    """parts: (name, samples [n] as cell ids, exact probabilities [cells]), checked as one family of
    ``family`` cells (default: the cells of parts) at ALPHA / family per cell."""
    cells = family or sum(int(probs.numel()) for _, _, probs in parts)
    limit = ALPHA / cells
    worst_p, worst = 2.0, ""
    for name, samples, probs in parts:
        probs = probs.double().numpy()
        n = samples.numel()
        counts = np.bincount(samples.numpy(), minlength=len(probs))
        assert len(counts) == len(probs), f"{name}: a sample is outside the {len(probs)} cells"
        p_values = binomial_p_values(counts, n, probs)
        cell = int(np.argmin(p_values))
        if p_values[cell] < worst_p:
            worst_p = float(p_values[cell])
            worst = f"{name} cell {cell}: {counts[cell]} seen, {probs[cell] * n:.1f} expected"
    return Check(worst_p >= limit, worst, worst_p, limit)


def check_chain(samples: torch.Tensor, exact: ExactTables) -> Check:
    """All marginals of positions 1..K+1 and all pairs (t, t+1) of one group's [rows, K+1] tokens."""
    length = samples.shape[1]
    parts = [(f"x{t + 1}", samples[:, t], exact.marginals[t]) for t in range(length)]
    parts += [(f"(x{t + 1}, x{t + 2})", samples[:, t] * V + samples[:, t + 1], exact.pairs[t])
              for t in range(length - 1)]
    return check_counts(parts)


def run_and_check(chain: Chain, groups: list[Group], seed: int, **kw) -> list[Check]:
    """Simulate, then check every group against the exact chain of its own target params."""
    outputs = simulate(chain, groups, seed, **kw)
    return [check_chain(out, exact_tables(chain.target_table(gr.params), chain.k + 1))
            for gr, out in zip(groups, outputs)]


# ---- mutants of verify (negative controls) -------------------------------------------------------------


def verify_with_mutated_uniforms(mutate: Callable[[torch.Tensor], torch.Tensor]) -> VerifyFn:
    """The real verify, with the uniforms it draws ([B, K+1]: one per proposal, then the bonus's)
    passed through ``mutate``. If verify stops drawing them through draw_uniforms the mutation
    has no effect, and the negative controls using this fail, which is the point."""
    real = verify_module.draw_uniforms

    def mutated_draw(*args, **kwargs):
        return mutate(real(*args, **kwargs))

    def mutant(*args, **kwargs):
        with mock.patch.object(verify_module, "draw_uniforms", mutated_draw):
            return verify(*args, **kwargs)

    return mutant


def _sqrt_ratio_after_position_1(u: torch.Tensor) -> torch.Tensor:
    # u < sqrt(p/q) <=> u^2 < p/q: squaring the uniforms of proposals 2..K makes verify accept
    # them with probability min(1, sqrt(p/q)) instead of min(1, p/q).
    u = u.clone()
    u[:, 1:-1] = u[:, 1:-1] ** 2
    return u


def _reuse_position_1_uniform(u: torch.Tensor) -> torch.Tensor:
    u = u.clone()
    u[:, 1:-1] = u[:, :1]
    return u


MUTANTS = {
    "accept positions >= 2 with sqrt(p/q)": verify_with_mutated_uniforms(_sqrt_ratio_after_position_1),
    "reuse position 1's uniform at positions >= 2": verify_with_mutated_uniforms(_reuse_position_1_uniform),
}
