"""The speedup model of ALGORITHM.md section 8: predict tokens/s of ar, sd and ssd, pick K and fan-out.

Inputs are component times in seconds (measured here by ``trtssd bench --calibrate``, or written
by hand for hardware we cannot run) and the workload's acceptance a and cache hit rate h.

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

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from trtssd.spec_decode.fanout import expected_hit_rate, optimal_fanout

log = logging.getLogger(__name__)

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
        return {_fmt_tokens(n): s for n, s in self.points}


class StepCostModel:
    """A draft forward's seconds by rows, measured live: a calibrated `CostCurve` for the shape,
    times a scale that follows the machine's load.

    `calibrate` sets the shape from a few timed forwards (the draft rank times 1, 2, 4, ... rows at
    start-up); `observe` folds every later forward into the scale, an exponential average of
    observed / predicted. Before calibration the shape is linear in the rows (as on a CPU, where
    every row costs compute); a GPU calibration comes out nearly flat.
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
        ratio = seconds / self._shape(max(int(rows), 1))
        self.scale = self._decay * self.scale + (1 - self._decay) * ratio

    def curve(self) -> CostCurve:
        """The current prediction as a plain curve (for `Timings`)."""
        return CostCurve(tuple((n, s * self.scale) for n, s in self._shape.points))


def _fmt_tokens(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else str(n)


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

    # Component times of ALGORITHM.md section 8, for a batch of b sequences.
    def target_step(self, b: int) -> float:
        return self.target(b)

    def verify(self, k: int, b: int) -> float:
        return self.target(b * (k + 1))

    def draft_step(self, b: int) -> float:
        return self.draft(b)

    def glue(self, k: int, b: int, hit_rate: float = 0.0) -> float:
        """Glue decode: K+1 tokens per row, or 1 on a cache hit (the hit branch's KV and logits
        are reused, only s_K is decoded)."""
        return self.draft(b * (1 + (1 - hit_rate) * k))

    def tree_step(self, budget: int, b: int) -> float:
        return (self.tree or self.draft)(b * budget) if budget > 0 else 0.0

    def prespeculation(self, k: int, budget: int, b: int, hit_rate: float = 0.0) -> float:
        """T_p: glue plus K tree steps, the draft's work that must fit in the verify window."""
        return self.glue(k, b, hit_rate) + (k * self.tree_step(budget, b) if budget > 0 else 0.0)

    def to_dict(self) -> dict:
        out = {"name": self.name, "target": self.target.to_dict(), "draft": self.draft.to_dict(),
               "handshake_s": self.handshake_s, "overhead_s": self.overhead_s, "fast_backup_s": self.fast_backup_s}
        if self.tree is not None:
            out["tree"] = self.tree.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "Timings":
        allowed = {"name", "target", "draft", "tree", "handshake_s", "overhead_s", "fast_backup_s"}
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(f"unknown timings field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        for required in ("target", "draft"):
            if required not in data:
                raise ValueError(f"timings need a {required!r} cost curve ({{tokens: seconds}})")
        return cls(
            target=CostCurve.from_mapping(data["target"], "target"),
            draft=CostCurve.from_mapping(data["draft"], "draft"),
            tree=CostCurve.from_mapping(data["tree"], "tree") if data.get("tree") is not None else None,
            handshake_s=data.get("handshake_s", 0.0),
            overhead_s=data.get("overhead_s", 0.0),
            fast_backup_s=data.get("fast_backup_s", 0.0),
            name=str(data.get("name", "unnamed")),
        )


def load_timings(path: str | Path) -> Timings:
    """Timings from a JSON or YAML file (see docs/benchmarks.md for the format)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"timings file not found: {path}")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, Mapping):
        raise ValueError(f"timings file {path} must hold a mapping at the top level")
    # A results.json from `trtssd bench` carries its calibration under "timings".
    if "timings" in data and "target" not in data:
        data = data["timings"]
        if not isinstance(data, Mapping):
            raise ValueError(f"{path} holds no calibrated timings (was the benchmark run with --no-calibrate?)")
    return Timings.from_dict(data)


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


def acceptance_mle(num_accepted: int, num_rounds: int, full_rounds: int) -> float:
    """Maximum-likelihood a from rounds of K proposals: accepted / positions tested.

    A round that stopped at a rejection tested its accepted positions plus the rejected one; a
    round that accepted all K tested K (the same estimator as the runtime's AcceptanceEstimator).
    """
    tested = num_accepted + num_rounds - full_rounds
    if num_rounds < 0 or not 0 <= full_rounds <= num_rounds or num_accepted < 0 or tested < 0:
        raise ValueError(f"inconsistent counts: accepted={num_accepted}, rounds={num_rounds}, full={full_rounds}")
    return num_accepted / tested if tested else 0.0


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


def _check_batch(b: int) -> None:
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise ValueError(f"batch_size must be an int >= 1; got {b!r}")


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1; got {k!r}")


def predict_ar(t: Timings, batch_size: int = 1) -> Prediction:
    _check_batch(batch_size)
    return Prediction("ar", batch_size, None, None, None, None, 1.0, t.overhead_s + t.target_step(batch_size), None)


def predict_sd(t: Timings, w: Workload, k: int, batch_size: int = 1) -> Prediction:
    _check_batch(batch_size)
    _check_k(k)
    round_s = t.overhead_s + t.handshake_s + k * t.draft_step(batch_size) + t.verify(k, batch_size)
    return Prediction("sd", batch_size, k, None, None, None, expected_tokens(w.acceptance, k), round_s, None)


def predict_ssd(t: Timings, w: Workload, k: int, budget: int, batch_size: int = 1, backup: str = "neural",
                fanout: Sequence[int] | None = None) -> Prediction:
    """SSD with one backup policy. h is the workload's, or the fan-out model's when not given
    (fan-out ``fanout`` if given, else the optimal one for ``budget``)."""
    _check_batch(batch_size)
    _check_k(k)
    if backup not in BACKUPS:
        raise ValueError(f"backup must be one of {BACKUPS}; got {backup!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0; got {budget!r}")
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
        round_s += sum(_binomial(b, m, 1 - h) * k * t.draft_step(m) for m in range(1, b + 1))
        tokens = e
    else:
        round_s += (1 - h**b) * t.fast_backup_s
        tokens = h * e + (1 - h) * expected_tokens(w.fast_acceptance, k)
    return Prediction(f"ssd-{backup}", b, k, budget, fan, h, tokens, round_s, t_p <= t.overhead_s + verify)


def _binomial(n: int, m: int, p: float) -> float:
    return math.comb(n, m) * p**m * (1 - p) ** (n - m)


# --- recommendation ------------------------------------------------------------------------------


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
        return max((self.ssd, self.sd, self.ar), key=lambda p: p.tokens_per_s)

    @property
    def ssd_speedup_over_ar(self) -> float:
        return self.ssd.tokens_per_s / self.ar.tokens_per_s

    @property
    def ssd_speedup_over_sd(self) -> float:
        return self.ssd.tokens_per_s / self.sd.tokens_per_s


def recommend(t: Timings, w: Workload, batch_size: int = 1, ks: Iterable[int] = DEFAULT_KS,
              budgets: Iterable[int] = DEFAULT_BUDGETS, backups: Iterable[str] = BACKUPS) -> Recommendation:
    """Best K for sd, best (K, fan-out budget, backup) for ssd, at one batch size. The draft rank
    calls it every round (one K, budgets 1..fanout_budget) to size its tree from live costs."""
    ks, budgets, backups = tuple(ks), tuple(budgets), tuple(backups)
    if not ks or not budgets or not backups:
        raise ValueError("ks, budgets and backups must be non-empty")
    sd = [predict_sd(t, w, k, batch_size) for k in ks]
    ssd = [predict_ssd(t, w, k, bud, batch_size, backup) for k in ks for bud in budgets for backup in backups]
    fastest = lambda preds: max(preds, key=lambda p: p.tokens_per_s)  # noqa: E731
    return Recommendation(batch_size, predict_ar(t, batch_size), fastest(sd), fastest(ssd), tuple(sd + ssd))


# --- presentation --------------------------------------------------------------------------------


def prediction_row(p: Prediction) -> dict:
    """A flat, JSON-ready view of one prediction."""
    return {
        "mode": p.mode, "batch_size": p.batch_size, "k": p.k, "budget": p.budget,
        "fanout": list(p.fanout) if p.fanout is not None else None,
        "hit_rate": None if p.hit_rate is None else round(p.hit_rate, 4),
        "tokens_per_round": round(p.tokens_per_round, 4), "round_time_ms": round(p.round_time_s * 1e3, 4),
        "tokens_per_s": round(p.tokens_per_s, 3), "draft_fits": p.draft_fits,
    }


def format_recommendations(recs: Sequence[Recommendation], timings: Timings, workload: Workload) -> str:
    """A markdown report: the best configuration of each mode per batch size."""
    lines = [
        f"timings: {timings.name}; acceptance a={workload.acceptance:.3f}, "
        + (f"hit rate h={workload.hit_rate:.3f}" if workload.hit_rate is not None
           else f"hit rate from fan-out (r={workload.r}, c={workload.c})"),
        "",
        "| batch | mode | K | budget | fan-out | h | tokens/round | round ms | tokens/s | vs ar | draft hidden |",
        "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for rec in recs:
        base = rec.ar.tokens_per_s
        best_fast = max((c for c in rec.candidates if c.mode == "ssd-fast"), key=lambda p: p.tokens_per_s)
        best_neural = max((c for c in rec.candidates if c.mode == "ssd-neural"), key=lambda p: p.tokens_per_s)
        for p in (rec.ar, rec.sd, best_neural, best_fast):
            row = prediction_row(p)
            lines.append(
                f"| {p.batch_size} | {p.mode} | {_cell(p.k)} | {_cell(p.budget)} | "
                f"{_cell(','.join(map(str, p.fanout)) if p.fanout else None)} | {_cell(row['hit_rate'])} | "
                f"{p.tokens_per_round:.2f} | {p.round_time_s * 1e3:.2f} | {p.tokens_per_s:.1f} | "
                f"{p.tokens_per_s / base:.2f}x | {_cell(p.draft_fits)} |"
            )
    lines.append("")
    for rec in recs:
        s = rec.ssd
        best = rec.best
        verdict = "use ssd" if best is s else f"fastest is {best.mode}" + (f" K={best.k}" if best.k else "")
        lines.append(
            f"batch {rec.batch_size}: {verdict}; best ssd: K={s.k}, fanout_budget={s.budget}, backup={s.mode[4:]} "
            f"({s.tokens_per_s:.1f} tok/s, {rec.ssd_speedup_over_ar:.2f}x ar, {rec.ssd_speedup_over_sd:.2f}x sd "
            f"at K={rec.sd.k})"
        )
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    return "-" if value is None else str(value)


# --- command line --------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    """'1-8' or '2,4,6'."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            return tuple(range(lo, hi + 1))
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'LO-HI' or a comma-separated list of ints; got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtssd plan", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("timings (a file, flags, or --measure; flags override the file)")
    src.add_argument("--timings", help="JSON/YAML timings file, or a results.json from `trtssd bench`")
    src.add_argument("--measure", action="store_true", help="calibrate the engine's models on this machine")
    src.add_argument("--engine", default=None, help="engine directory for --measure (default: the embedded one)")
    src.add_argument("--target", default=None, help="--measure this target model path instead of an engine")
    src.add_argument("--draft", default=None, help="--measure this draft model path (with --target)")
    src.add_argument("--target-cost", help="target forward cost 'tokens:seconds,...'")
    src.add_argument("--draft-cost", help="draft forward cost 'tokens:seconds,...'")
    src.add_argument("--tree-cost", help="draft tree-step cost 'tokens:seconds,...' (default: the draft's)")
    src.add_argument("--handshake-s", type=float, help="target<->draft exchange per round")
    src.add_argument("--overhead-s", type=float, help="target host work per round")
    src.add_argument("--fast-backup-s", type=float, help="fast backup proposal per missed row")
    src.add_argument("--save-timings", help="write the timings used to this JSON file")
    wl = p.add_argument_group("workload")
    wl.add_argument("--acceptance", type=float, default=0.7, help="per-position acceptance a (default 0.7)")
    wl.add_argument("--mean-acceptance-length", type=float, help="measured tokens/round at --measured-k; sets a")
    wl.add_argument("--measured-k", type=int, default=5, help="K of --mean-acceptance-length (default 5)")
    wl.add_argument("--hit-rate", type=float, help="cache hit rate h (default: predicted from the fan-out)")
    wl.add_argument("--r", type=float, default=1.0, help="miss power-law exponent (default 1)")
    wl.add_argument("--c", type=float, default=0.5, help="miss rate with one candidate (default 0.5)")
    wl.add_argument("--fast-acceptance", type=float, default=0.0, help="acceptance of fast-backup proposals")
    sw = p.add_argument_group("search")
    sw.add_argument("--batch", type=_int_list, default=(1,), help="batch sizes, e.g. '1,2,4,8' or '1-8'")
    sw.add_argument("--k", type=_int_list, default=DEFAULT_KS, help="lookaheads to search (default 1-8)")
    sw.add_argument("--budgets", type=_int_list, default=DEFAULT_BUDGETS, help="fan-out budgets to search")
    p.add_argument("--json", action="store_true", help="print every evaluated configuration as JSON")
    return p


def _timings_from_args(args: argparse.Namespace) -> Timings:
    base: Timings | None = None
    if args.timings:
        base = load_timings(args.timings)
    elif args.measure:
        from trtssd.bench import measure_timings

        base = measure_timings(args.engine, args.target, args.draft, batch_sizes=args.batch, ks=args.k,
                               budgets=args.budgets)
    updates = {}
    for flag, name in (("target_cost", "target"), ("draft_cost", "draft"), ("tree_cost", "tree")):
        if getattr(args, flag):
            updates[name] = CostCurve.parse(getattr(args, flag), f"--{flag.replace('_', '-')}")
    for name in ("handshake_s", "overhead_s", "fast_backup_s"):
        if getattr(args, name) is not None:
            updates[name] = getattr(args, name)
    if base is None:
        missing = [f"--{n}-cost" for n in ("target", "draft") if n not in updates]
        if missing:
            raise ValueError(f"give --timings FILE, --measure, or both {' and '.join(missing)}")
        return Timings(name="command line", **updates)
    return replace(base, **updates, name=base.name + (" + flags" if updates else ""))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        timings = _timings_from_args(args)
        a = args.acceptance
        if args.mean_acceptance_length is not None:
            a = acceptance_from_length(args.mean_acceptance_length, args.measured_k)
        workload = Workload(a, args.hit_rate, args.r, args.c, args.fast_acceptance)
        recs = [recommend(timings, workload, b, args.k, args.budgets) for b in args.batch]
    except ValueError as err:
        parser.error(str(err))
        return 2
    if args.save_timings:
        Path(args.save_timings).write_text(json.dumps(timings.to_dict(), indent=1) + "\n")
    if args.json:
        payload = {"timings": timings.to_dict(), "workload": asdict(workload),
                   "batches": [{"batch_size": r.batch_size, "best": {m: prediction_row(getattr(r, m)) for m in
                                                                    ("ar", "sd", "ssd")},
                                "candidates": [prediction_row(c) for c in r.candidates]} for r in recs]}
        sys.stdout.write(json.dumps(payload, indent=1) + "\n")
    else:
        sys.stdout.write(format_recommendations(recs, timings, workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
