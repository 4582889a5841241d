"""The speedup model of docs/algorithm.md section 8: predict tokens/s of ar, sd and ssd, pick K
and fan-out.

The draft rank uses it live every round (`StepCostModel`, `best_ssd`; its backup choice,
`spec_decode.backup.prefer_neural`); `trtssd plan` and `trtssd bench` use it offline. Inputs are
component times in seconds (measured by trtssd/runtime/calibration.py, or written by hand for
hardware we cannot run) and the workload's acceptance a and cache hit rate h. `decayed` is the one
running average every live estimate follows the machine with.

Times are modelled per forward pass as a function of the tokens it processes for the whole
batch (a ``CostCurve``), because every component is such a pass:

    target 1-token step (ar)   target(b)              verify of K+1 tokens   target(b (K+1))
    draft step (sd, jit)       draft(b)               glue decode            draft(b (K+1))
    tree step (B branches/seq) tree(b B)

Per round, per sequence, E = (1 - a^(K+1)) / (1 - a) tokens come out of a real speculation.
With o = target-side host overhead per round and s = the target<->draft handshake:

    ar:   b tokens in  o + target(b)
    sd:   b E      in  o + s + K draft(b) + verify
    ssd:  T_p = glue + K tree(b B) (the glue decodes 1 token per row after a hit, K+1 after a
          miss); a round costs s + max(o + verify, T_p) plus, on a miss,
          the backup: neural re-drafts the m missing rows just in time (K draft(m), the whole
          batch waits; E tokens per row), fast costs ~nothing but yields E_fast (about 1).

With o = s = 0 and b = 1 this is the section 8 formula in units of one verify:
ssd = [h E + (1 - h) E_miss] / [h max(1, T_p) + (1 - h)(T_b + max(1, T_p))].
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from trtssd.spec_decode.fanout import expected_hit_rate, optimal_fanout

DEFAULT_KS = tuple(range(1, 9))  # lookaheads searched by `recommend`
DEFAULT_BUDGETS = (1, 2, 4, 6, 8, 12, 16, 24, 32)  # fan-out budgets (branches per sequence) searched
BACKUPS = ("neural", "fast")


def _positive(value: float, name: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}; got {value!r}")
    return float(value)


def _probability(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1]; got {value!r}")
    return float(value)


def decayed(average: float, value: float, decay: float) -> float:
    """One step of an exponential moving average: the running estimates of `StepCostModel` and
    `BackupCosts` both follow the machine this way (recent rounds count most)."""
    return decay * average + (1 - decay) * value


# --- component times -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward pass as a function of the tokens it processes (whole batch).

    Piecewise linear through the measured points. Below the first point the first value holds (a
    pass never gets cheaper than the smallest measured one); above the last point the last
    segment's slope continues (one point: constant, the flat regime of a GPU at small batch), but
    never below the last value: a noisy calibration whose last segment falls must not predict that
    bigger passes cost less, or nothing.
    """

    points: tuple[tuple[float, float], ...]  # (tokens, seconds), strictly increasing tokens

    def __post_init__(self) -> None:
        pts = tuple((float(n), float(s)) for n, s in self.points)
        if not pts:
            raise ValueError("a cost curve needs at least one (tokens, seconds) point")
        for n, s in pts:
            _positive(n, "cost curve tokens")
            _positive(s, "cost curve seconds")
        pts = tuple(sorted(pts))
        if any(a[0] == b[0] for a, b in zip(pts, pts[1:])):
            raise ValueError(f"cost curve has repeated token counts: {[n for n, _ in pts]}")
        object.__setattr__(self, "points", pts)

    @classmethod
    def from_mapping(cls, mapping: Mapping, name: str = "cost curve") -> "CostCurve":
        """{tokens: seconds}; keys may be strings (JSON)."""
        if not isinstance(mapping, Mapping) or not mapping:
            raise ValueError(f"{name} must be a non-empty mapping of tokens to seconds; got {mapping!r}")
        try:
            return cls(tuple((float(n), float(s)) for n, s in mapping.items()))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}: {err}") from None

    @classmethod
    def parse(cls, text: str, name: str = "cost curve") -> "CostCurve":
        """'tokens:seconds,...' e.g. '1:0.020,8:0.024' (a plain number = the same cost everywhere)."""
        try:
            if ":" not in text:
                return cls(((1.0, float(text)),))
            pairs = [item.split(":") for item in text.split(",") if item.strip()]
            return cls(tuple((float(n), float(s)) for n, s in pairs))
        except ValueError as err:
            raise ValueError(f"{name} must look like '1:0.02,8:0.03' (tokens:seconds); got {text!r} ({err})") from None

    def __call__(self, tokens: float) -> float:
        pts = self.points
        if len(pts) == 1 or tokens <= pts[0][0]:
            return pts[0][1]
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if tokens <= n1:
                return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = pts[-2], pts[-1]
        return max(s1 + (s1 - s0) * (tokens - n1) / (n1 - n0), s1)

    def to_dict(self) -> dict[str, float]:
        return {str(int(n)) if n.is_integer() else str(n): s for n, s in self.points}


class StepCostModel:
    """A draft forward's seconds by rows, measured live: a calibrated `CostCurve` for the shape,
    times a scale that follows the machine's load.

    `calibrate` sets the shape from a few timed forwards (the draft rank times 1, 2, 4, ... rows at
    start-up with `time_forwards`); `observe` folds every later forward into the scale, an
    exponential average of observed / predicted. Before calibration the shape is linear in the rows
    (as on a CPU, where every row costs compute); a GPU calibration comes out nearly flat.
    """

    def __init__(self, decay: float = 0.8) -> None:
        self._shape = CostCurve(((1.0, 0.01), (2.0, 0.02)))
        self.scale = 1.0
        self._decay = decay

    def calibrate(self, points: Mapping[int, float]) -> None:
        """Set the shape from {rows: seconds} (at least one point, rows >= 1, seconds > 0)."""
        if not points or any(r < 1 or s <= 0 for r, s in points.items()):
            raise ValueError(f"calibration points must map rows >= 1 to seconds > 0, got {points!r}")
        self._shape = CostCurve.from_mapping(points, "calibration")
        self.scale = 1.0

    def predict(self, rows: int) -> float:
        return self.scale * self._shape(max(int(rows), 1))

    def observe(self, rows: int, seconds: float) -> None:
        self.scale = decayed(self.scale, seconds / self._shape(max(int(rows), 1)), self._decay)

    def curve(self) -> CostCurve:
        """The current prediction as a plain curve (for `Timings`)."""
        return CostCurve(tuple((n, s * self.scale) for n, s in self._shape.points))


@dataclass(frozen=True)
class Timings:
    """Everything time-related the model needs, for one machine and one pair of models."""

    target: CostCurve  # target forward: seconds vs tokens in the pass (1-token steps and verifies)
    draft: CostCurve  # draft chain forward: seconds vs tokens (draft steps, glue decode)
    tree: CostCurve | None = None  # draft tree-attention step vs tokens; None = the draft curve
    handshake_s: float = 0.0  # one target<->draft exchange per round, drafting excluded
    overhead_s: float = 0.0  # target-side host work per round (sampling, verify, commit, detokenize)
    fast_backup_s: float = 0.0  # one fast (n-gram) proposal for a missed row
    name: str = "unnamed"  # shown in tables: where these numbers come from

    def __post_init__(self) -> None:
        for name in ("handshake_s", "overhead_s", "fast_backup_s"):
            _positive(getattr(self, name), name, allow_zero=True)

    # Component times of docs/algorithm.md section 8, for a batch of b sequences (a 1-token step of
    # either model is `target(b)` or `draft(b)`).
    def verify(self, k: int, b: int) -> float:
        return self.target(b * (k + 1))

    def glue(self, k: int, b: int, hit_rate: float = 0.0) -> float:
        """Glue decode: K+1 tokens per row, or 1 on a cache hit (the hit branch's KV and logits
        are reused, only s_K is decoded)."""
        return self.draft(b * (1 + (1 - hit_rate) * k))

    def tree_step(self, budget: int, b: int) -> float:
        return (self.tree or self.draft)(b * budget) if budget > 0 else 0.0

    def prespeculation(self, k: int, budget: int, b: int, hit_rate: float = 0.0) -> float:
        """T_p: glue plus K tree steps, the draft's work that must fit in the verify window."""
        return self.glue(k, b, hit_rate) + k * self.tree_step(budget, b)

    def to_dict(self) -> dict:
        out = {"name": self.name, "target": self.target.to_dict(), "draft": self.draft.to_dict(),
               "handshake_s": self.handshake_s, "overhead_s": self.overhead_s, "fast_backup_s": self.fast_backup_s}
        if self.tree is not None:
            out["tree"] = self.tree.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "Timings":
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(f"unknown timings field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        for required in ("target", "draft"):
            if required not in data:
                raise ValueError(f"timings need a {required!r} cost curve ({{tokens: seconds}})")
        fields = {**data, "name": str(data.get("name", "unnamed"))}
        for curve in ("target", "draft", "tree"):
            if fields.get(curve) is not None:
                fields[curve] = CostCurve.from_mapping(fields[curve], curve)
        return cls(**fields)


# --- workload ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What the models and prompts give: acceptance, and how predictable the bonus token is."""

    acceptance: float  # a: per-position acceptance of a draft proposal (i.i.d. model)
    hit_rate: float | None = None  # h per sequence per round; None = predict from the fan-out
    r: float = 1.0  # power-law exponent of the miss rate c F^-r with F cached candidates
    c: float = 0.5  # miss rate with one cached candidate
    fast_acceptance: float = 0.0  # per-position acceptance of the fast (n-gram) backup's proposals

    def __post_init__(self) -> None:
        _probability(self.acceptance, "acceptance")
        if self.hit_rate is not None:
            _probability(self.hit_rate, "hit_rate")
        _positive(self.r, "r")
        if not 0 < self.c <= 1:
            raise ValueError(f"c must be in (0, 1]; got {self.c!r}")
        _probability(self.fast_acceptance, "fast_acceptance")


def expected_tokens(a: float, k: int) -> float:
    """E = (1 - a^(K+1)) / (1 - a): tokens per round (accepted drafts + the bonus)."""
    _probability(a, "acceptance")
    if k < 0:
        raise ValueError(f"k must be >= 0; got {k!r}")
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def acceptance_from_length(mean_length: float, k: int) -> float:
    """The a whose E(a, K) equals a measured mean acceptance length (tokens per round)."""
    if not 1 <= mean_length <= k + 1:
        raise ValueError(f"mean acceptance length must be in [1, K+1={k + 1}]; got {mean_length!r}")
    if mean_length in (1, k + 1):
        return 0.0 if mean_length == 1 else 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):  # E is increasing in a; bisection to machine precision
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < mean_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# --- predictions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    mode: str  # "ar", "sd", "ssd-neural" or "ssd-fast"
    batch_size: int
    k: int | None  # lookahead (None for ar)
    budget: int | None  # fan-out budget per sequence (ssd only)
    fanout: tuple[int, ...] | None  # per-depth fan-out used for the hit rate (ssd, when predicted)
    hit_rate: float | None  # h used (ssd only)
    tokens_per_round: float  # per sequence
    round_time_s: float  # expected seconds per round for the whole batch
    draft_fits: bool | None  # ssd: T_p <= verify + host overhead, i.e. drafting is hidden behind verification

    @property
    def tokens_per_s(self) -> float:
        """Aggregate over the batch."""
        return self.batch_size * self.tokens_per_round / self.round_time_s

    def to_dict(self) -> dict:
        """A flat, JSON-ready view for reports (rounded to what a table shows)."""
        return {
            "mode": self.mode, "batch_size": self.batch_size, "k": self.k, "budget": self.budget,
            "fanout": list(self.fanout) if self.fanout is not None else None,
            "hit_rate": None if self.hit_rate is None else round(self.hit_rate, 4),
            "tokens_per_round": round(self.tokens_per_round, 4), "round_time_ms": round(self.round_time_s * 1e3, 4),
            "tokens_per_s": round(self.tokens_per_s, 3), "draft_fits": self.draft_fits,
        }


def check_int(value: int, name: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")


def predict_ar(t: Timings, batch_size: int = 1) -> Prediction:
    check_int(batch_size, "batch_size")
    return Prediction("ar", batch_size, None, None, None, None, 1.0, t.overhead_s + t.target(batch_size), None)


def predict_sd(t: Timings, w: Workload, k: int, batch_size: int = 1) -> Prediction:
    check_int(batch_size, "batch_size")
    check_int(k, "k")
    round_s = t.overhead_s + t.handshake_s + k * t.draft(batch_size) + t.verify(k, batch_size)
    return Prediction("sd", batch_size, k, None, None, None, expected_tokens(w.acceptance, k), round_s, None)


def predict_ssd(t: Timings, w: Workload, k: int, budget: int, batch_size: int = 1, backup: str = "neural",
                fanout: Sequence[int] | None = None) -> Prediction:
    """SSD with one backup policy. h is the workload's, or the fan-out model's when not given
    (fan-out ``fanout`` if given, else the optimal one for ``budget``)."""
    check_int(batch_size, "batch_size")
    check_int(k, "k")
    if backup not in BACKUPS:
        raise ValueError(f"backup must be one of {BACKUPS}; got {backup!r}")
    check_int(budget, "budget", minimum=0)
    fan = None
    h = w.hit_rate
    if h is None:
        fan = tuple(fanout) if fanout is not None else tuple(optimal_fanout(budget, k, w.acceptance, w.r, w.c))
        if len(fan) != k + 1 or sum(fan) != budget:
            raise ValueError(f"fanout must have k+1={k + 1} entries summing to budget={budget}; got {fan}")
        h = expected_hit_rate(fan, w.acceptance, w.r, w.c)
    b = batch_size
    e = expected_tokens(w.acceptance, k)
    verify = t.verify(k, b)
    t_p = t.prespeculation(k, budget, b, h)
    # The target's host work after verifying overlaps the draft's pre-speculation as well.
    round_s = t.handshake_s + max(t.overhead_s + verify, t_p)
    if backup == "neural":
        # Rows that missed are re-drafted together; the whole batch waits for them.
        round_s += sum(_binomial(b, m, 1 - h) * k * t.draft(m) for m in range(1, b + 1))
        tokens = e
    else:
        round_s += (1 - h**b) * t.fast_backup_s
        tokens = h * e + (1 - h) * expected_tokens(w.fast_acceptance, k)
    return Prediction(f"ssd-{backup}", b, k, budget, fan, h, tokens, round_s, t_p <= t.overhead_s + verify)


def _binomial(n: int, m: int, p: float) -> float:
    return math.comb(n, m) * p**m * (1 - p) ** (n - m)


# --- recommendation ------------------------------------------------------------------------------


def _fastest(predictions: Iterable[Prediction]) -> Prediction:
    return max(predictions, key=lambda p: p.tokens_per_s)


def ssd_candidates(t: Timings, w: Workload, batch_size: int = 1, ks: Iterable[int] = DEFAULT_KS,
                   budgets: Iterable[int] = DEFAULT_BUDGETS, backups: Iterable[str] = BACKUPS) -> list[Prediction]:
    """Every ssd configuration (K, budget, backup). The fan-out does not depend on the backup: it
    is optimised once per (K, budget), the most expensive step of the search."""
    ks, budgets, backups = tuple(ks), tuple(budgets), tuple(backups)
    if not ks or not budgets or not backups:
        raise ValueError("ks, budgets and backups must be non-empty")
    out = []
    for k in ks:
        for budget in budgets:
            fan = None if w.hit_rate is not None else optimal_fanout(budget, k, w.acceptance, w.r, w.c)
            out += [predict_ssd(t, w, k, budget, batch_size, backup, fan) for backup in backups]
    return out


def best_ssd(t: Timings, w: Workload, batch_size: int = 1, ks: Iterable[int] = DEFAULT_KS,
             budgets: Iterable[int] = DEFAULT_BUDGETS, backups: Iterable[str] = BACKUPS) -> Prediction:
    """The fastest ssd configuration. The draft rank calls it every round (its one K, budgets
    1..fanout_budget) to size its tree from live costs; it needs neither ar nor sd."""
    return _fastest(ssd_candidates(t, w, batch_size, ks, budgets, backups))


@dataclass(frozen=True)
class Recommendation:
    batch_size: int
    ar: Prediction
    sd: Prediction  # best K
    ssd: Prediction  # best K, budget and backup
    candidates: tuple[Prediction, ...]  # every sd / ssd configuration evaluated

    @property
    def best(self) -> Prediction:
        """The fastest of ar, the best sd and the best ssd."""
        return _fastest((self.ssd, self.sd, self.ar))

    @property
    def ssd_speedup_over_ar(self) -> float:
        return self.ssd.tokens_per_s / self.ar.tokens_per_s

    @property
    def ssd_speedup_over_sd(self) -> float:
        return self.ssd.tokens_per_s / self.sd.tokens_per_s


def recommend(t: Timings, w: Workload, batch_size: int = 1, ks: Iterable[int] = DEFAULT_KS,
              budgets: Iterable[int] = DEFAULT_BUDGETS, backups: Iterable[str] = BACKUPS) -> Recommendation:
    """Best K for sd, best (K, fan-out budget, backup) for ssd, at one batch size."""
    ks = tuple(ks)
    ssd = ssd_candidates(t, w, batch_size, ks, budgets, backups)
    sd = [predict_sd(t, w, k, batch_size) for k in ks]
    return Recommendation(batch_size, predict_ar(t, batch_size), _fastest(sd), _fastest(ssd), tuple(sd + ssd))
