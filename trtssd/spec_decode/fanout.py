"""Optimal fan-out per depth and online estimates of its inputs (docs/algorithm.md section 7).

Model: the verification outcome "k accepted" has probability pi_k = (1 - a) a^k for k < K and
pi_K = a^K (acceptance a, i.i.d. per position). With F >= 1 cached candidates at depth k the
bonus is missed with probability c F^(-r) (a power law; c = miss rate with one candidate); with
F = 0 it is always missed. The fan-out maximises the expected hit rate
sum_k pi_k hit(F_k) subject to sum_k F_k = B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


def _check_model(budget: int, k: int, a: float, r: float, c: float | None = None) -> None:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k (lookahead K) must be an int >= 0, got {k!r}")
    if not 0 <= a <= 1:
        raise ValueError(f"a (acceptance rate) must be in [0, 1], got {a!r}")
    if not (math.isfinite(r) and r > 0):
        raise ValueError(f"r (power-law exponent) must be a finite number > 0, got {r!r}")
    if c is not None and not 0 < c <= 1:
        raise ValueError(f"c (miss rate with one candidate) must be in (0, 1], got {c!r}")


def outcome_probs(k: int, a: float) -> list[float]:
    """pi_j, j = 0..K: probability that exactly j of K proposals are accepted."""
    return [(1 - a) * a**j for j in range(k)] + [a**k]


def hit_rate(fanout: int, r: float, c: float) -> float:
    """Probability that the bonus is among ``fanout`` cached candidates (power-law model)."""
    return 0.0 if fanout == 0 else 1.0 - c * fanout ** (-r)


def expected_hit_rate(fanout: Sequence[int], a: float, r: float, c: float) -> float:
    """The objective: sum_j pi_j hit(F_j) for an allocation F_0..F_K."""
    pis = outcome_probs(len(fanout) - 1, a)
    return sum(pi * hit_rate(f, r, c) for pi, f in zip(pis, fanout))


def optimal_fanout(budget: int, k: int, a: float, r: float, c: float = 0.5) -> list[int]:
    """The integer allocation F_0..F_K with sum exactly ``budget`` maximising the expected hit rate.

    c defaults to 0.5 (a plausible one-candidate miss rate before anything is measured); it only
    matters for whether a depth should get no candidate at all, since for F >= 1 the objective
    is c-independent up to a constant. Exact dynamic programme over depths, O(K B^2): greedy
    marginal allocation would need hit(F) concave from F = 0, which fails when c > 1/(2 - 2^-r).
    """
    _check_model(budget, k, a, r, c)
    pis = outcome_probs(k, a)
    counts = np.arange(budget + 1)
    # best[b]: best objective of the depths seen so far using exactly b candidates.
    best = np.zeros(budget + 1)
    best[1:] = -np.inf
    choices = []
    used_before = counts[:, None] - counts[None, :]  # [b, f] -> candidates left for earlier depths
    for pi in pis:
        gain = pi * np.array([hit_rate(int(f), r, c) for f in counts])
        total = np.where(used_before >= 0, best[np.clip(used_before, 0, None)] + gain[None, :], -np.inf)
        choices.append(total.argmax(axis=1))
        best = total.max(axis=1)
    fanout = []
    left = budget
    for choice in reversed(choices):
        f = int(choice[left])
        fanout.append(f)
        left -= f
    return fanout[::-1]


def continuous_fanout(budget: int, k: int, a: float, r: float) -> list[float]:
    """The real-valued optimum of section 7: F_j = B pi_j^(1/(1+r)) / sum_i pi_i^(1/(1+r)).

    For 0 < a < 1 this is the capped geometric series F_j = F_0 rho^j (j < K),
    F_K = F_0 rho^K (1 - a)^(-1/(1+r)), rho = a^(1/(1+r)).
    """
    _check_model(budget, k, a, r)
    weights = [pi ** (1 / (1 + r)) for pi in outcome_probs(k, a)]
    total = sum(weights)
    return [budget * w / total for w in weights]


def optimal_miss_rate(budget: int, k: int, a: float, r: float, c: float) -> float:
    """Miss rate of the continuous optimum, c S^(1+r) / B^r with S = sum_j pi_j^(1/(1+r))."""
    _check_model(budget, k, a, r, c)
    s = sum(pi ** (1 / (1 + r)) for pi in outcome_probs(k, a))
    return c * s ** (1 + r) / budget**r


def _as_array(values: torch.Tensor | Sequence[int] | int) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy().reshape(-1)
    return np.asarray(values).reshape(-1)


class AcceptanceEstimator:
    """Online acceptance of draft proposals, per position and pooled: the one estimate the
    draft's fan-out (the i.i.d. a) and the target's K per round (position by position) read.

    A round's row with n proposals verified and k accepted tested positions 0..k (k passes and
    the failing one) when k < n, and 0..n-1 when all passed: position i is tested when every
    proposal before it passed. Position i's estimate is its passed / tested; under the i.i.d.
    model the maximum-likelihood a is the pooled ratio, sum(k) / sum(tested). Plain accepted /
    proposed would count positions after a rejection as failures and underestimate a. Old
    evidence fades exponentially with a time constant of ``window`` tested positions; the prior
    acts as ``prior_weight`` positions, pooled and at each position.
    """

    def __init__(self, prior: float = 0.7, prior_weight: float = 10.0, window: float = 5000.0) -> None:
        if not 0 <= prior <= 1:
            raise ValueError(f"prior must be in [0, 1], got {prior!r}")
        if prior_weight <= 0 or window <= 0:
            raise ValueError(f"prior_weight and window must be > 0, got {prior_weight!r}, {window!r}")
        self._prior = float(prior)
        self._weight = float(prior_weight)  # the prior's, faded with the evidence
        self._window = float(window)
        self._passed: list[float] = []  # per position
        self._tested: list[float] = []

    def update(
        self,
        num_accepted: torch.Tensor | Sequence[int] | int,
        num_proposed: torch.Tensor | Sequence[int] | int,
    ) -> None:
        """Record rounds: per row, accepted count and number of proposals verified."""
        k = _as_array(num_accepted).astype(np.int64)
        n = _as_array(num_proposed).astype(np.int64)
        if k.shape != n.shape or np.any(k < 0) or np.any(k > n):
            raise ValueError("num_accepted and num_proposed must have the same shape and 0 <= k <= n")
        positions = int(n.max(initial=0))
        tested = [float(np.sum((n > i) & (k >= i))) for i in range(positions)]
        fade = math.exp(-sum(tested) / self._window)
        grow = max(0, positions - len(self._passed))
        self._passed += [0.0] * grow
        self._tested += [0.0] * grow
        self._weight *= fade
        for i in range(len(self._passed)):
            self._passed[i] = self._passed[i] * fade + (float(np.sum(k > i)) if i < positions else 0.0)
            self._tested[i] = self._tested[i] * fade + (tested[i] if i < positions else 0.0)

    @property
    def value(self) -> float:
        """The pooled acceptance a (the i.i.d. model's)."""
        return (self._prior * self._weight + sum(self._passed)) / (self._weight + sum(self._tested))

    def rate(self, position: int) -> float:
        """Position ``position``'s acceptance: it passed, given every earlier one did."""
        if position >= len(self._passed):
            return self._prior
        return (self._prior * self._weight + self._passed[position]) / (self._weight + self._tested[position])


@dataclass(frozen=True)
class PowerLaw:
    """miss(F) = c F^(-r) for F >= 1."""

    c: float
    r: float

    def miss(self, fanout: int) -> float:
        return 1.0 if fanout == 0 else min(1.0, self.c * fanout ** (-self.r))


class PowerLawEstimator:
    """Online fit of the miss power law from (fan-out F, hit) observations.

    Keeps faded hit/trial counts per F and fits log miss = log c - r log F by least squares
    weighted by trials, over every F >= 1 with at least ``min_trials`` trials (F = 0 always
    misses and says nothing about c or r). With data at one F only, r keeps its prior and c is
    fitted; with none, both are priors. Results are clamped to r in [r_min, r_max], c in
    [c_min, 1] so a noisy start cannot produce a degenerate fan-out.
    """

    def __init__(
        self,
        prior: PowerLaw = PowerLaw(c=0.5, r=1.0),
        min_trials: int = 20,
        window: float = 20000.0,
        r_range: tuple[float, float] = (0.05, 4.0),
        c_min: float = 0.01,
    ) -> None:
        self.prior = prior
        self.min_trials = min_trials
        self._window = float(window)
        self._r_range = r_range
        self._c_min = c_min
        self._hits = np.zeros(0)
        self._trials = np.zeros(0)

    def update(self, fanout: torch.Tensor | Sequence[int], hit: torch.Tensor | Sequence[bool]) -> None:
        f = _as_array(fanout).astype(np.int64)
        h = _as_array(hit).astype(bool)
        if f.shape != h.shape or np.any(f < 0):
            raise ValueError("fanout and hit must have the same shape, with fanout >= 0")
        size = max(len(self._trials), int(f.max(initial=0)) + 1)
        fade = math.exp(-len(f) / self._window)
        self._trials = np.pad(self._trials, (0, size - len(self._trials))) * fade
        self._hits = np.pad(self._hits, (0, size - len(self._hits))) * fade
        self._trials += np.bincount(f, minlength=size)
        self._hits += np.bincount(f, weights=h.astype(float), minlength=size)

    def estimate(self) -> PowerLaw:
        fs = np.nonzero(self._trials >= self.min_trials)[0]
        fs = fs[fs >= 1]
        if len(fs) == 0:
            return self.prior
        trials = self._trials[fs]
        # Add-half smoothing keeps log(miss) finite when a fan-out never missed.
        miss = (trials - self._hits[fs] + 0.5) / (trials + 1.0)
        x, y = np.log(fs.astype(float)), np.log(miss)
        if len(fs) == 1:
            r = self.prior.r
        else:
            x_mean = np.average(x, weights=trials)
            y_mean = np.average(y, weights=trials)
            r = -np.sum(trials * (x - x_mean) * (y - y_mean)) / np.sum(trials * (x - x_mean) ** 2)
        r = float(np.clip(r, *self._r_range))
        log_c = np.average(y + r * x, weights=trials)
        c = float(np.clip(math.exp(log_c), self._c_min, 1.0))
        return PowerLaw(c=c, r=r)
