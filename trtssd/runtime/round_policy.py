"""Every adaptive decision of the target's rounds, in one place: the round policy.

The target loop asks it what to run and tells it what happened; nothing else in the loop adapts.

- Plain or speculative: load control (`load_control.RoundChooser`), bounded by its ceiling.
- Which k: K per round (`k_per_round.LengthChooser`).
- Whose cores: plain rounds (and a prefill the draft takes no part in) borrow the draft's cores
  (`core_lending.CoreLending`), unless the draft is busy (`start_plain_round`).
- The seed promise: a batch holding a seeded sampled request keeps speculating (`speculate`).

Calibration is a step of its own (`calibrate_target`, called by the launcher: timing forwards
takes seconds, and is stored per machine and model); constructing a policy times nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from trtssd.backends.base import Executor
from trtssd.config import Mode, SpeculativeConfig
from trtssd.runtime.core_lending import CoreLending, on_own_thread
from trtssd.runtime.k_per_round import LengthChooser
from trtssd.runtime.load_control import RoundChooser, speculation_ceiling
from trtssd.runtime.sequence import Sequence
from trtssd.runtime.calibration import calibrated_forwards
from trtssd.spec_decode.speedup import CostCurve, StepCostModel

log = logging.getLogger(__name__)

STEADY_AFTER_ROUNDS = 2  # a row's first speculative rounds (after admission or plain ones) are transitional
CEILING_MAX_ROWS = 64  # the widest target forward timed for load control's ceiling (wider: extrapolated)


@dataclass(frozen=True)
class TargetCosts:
    """The target's timed forwards, seconds by rows (`calibrate_target`); None: not timed."""

    forwards: Mapping[int, float] | None = None  # on the target's own cores (speculation's verify)
    plain: Mapping[int, float] | None = None  # on the cores plain rounds run on (the draft's too, where lent)


@dataclass(frozen=True)
class RoundReport:
    """What a round the policy chose did, for it to learn from."""

    speculative: bool
    batch: int
    tokens: int  # emitted (a stop inside the round cuts accepted tokens too)
    seconds: float  # the round's, less the cache upkeep paid within it
    steady: bool  # not a transitional round (see load_control.py)
    k: int = 0  # speculative rounds: proposals verified per row
    accepted: tuple[int, ...] = ()  # speculative rounds: per row
    verify_s: float = 0.0
    wait_s: float = 0.0  # the target's wait for the draft's answer


def calibrate_target(target: Executor, spec: SpeculativeConfig, max_batch: int, draft_step_s: Mapping[int, float] | None,
                     lending: CoreLending | None, executor_verifies: bool = True) -> TargetCosts:
    """Time the target's forwards the round policy needs, once per machine and model (stored like
    the draft's calibration): for load control's ceiling (with the draft's calibrated forwards
    ``draft_step_s``) and forecast of plain rounds, and for K per round's verify costs. Only
    where the loop's own executor verifies (``executor_verifies``): another target's rounds are
    not its forwards. A timing that fails is logged and left out (an optimisation)."""
    wants_ceiling = spec.plain_under_load and bool(draft_step_s) and executor_verifies
    wants_lengths = spec.k_per_round and spec.mode is not Mode.AR and executor_verifies
    if not (wants_ceiling or wants_lengths):
        return TargetCosts()
    rows = min(CEILING_MAX_ROWS, max_batch * (spec.k + 1))
    forwards = _timed("the target's forwards", lambda: calibrated_forwards(target, rows, side="target"))
    plain = None
    if wants_ceiling and forwards:
        plain = forwards if lending is None else _timed("the target's plain forwards",
                                                        lambda: _plain_forwards(target, lending, min(CEILING_MAX_ROWS, max_batch)))
    return TargetCosts(forwards, plain)


def _plain_forwards(target: Executor, lending: CoreLending, rows: int) -> dict[int, float] | None:
    """Plain rounds' forwards, timed on the cores they run on (the draft's too), on a thread of
    their own (`on_own_thread`: llama.cpp's workers keep the cores of the thread that started them)."""
    def timed() -> dict[int, float] | None:
        lending.for_round(plain=True)
        try:
            return calibrated_forwards(target, rows, side="target", plain_threads=lending.lent[1])
        finally:
            lending.for_round(plain=False)

    try:
        return on_own_thread(timed)
    finally:
        lending.forget_threads()


def _timed(what: str, measure):
    try:
        return measure()
    except Exception:  # noqa: BLE001 - an optimisation
        log.exception("timing %s failed", what)
        return None


class RoundPolicy:
    def __init__(self, spec: SpeculativeConfig, lending: CoreLending | None = None, costs: TargetCosts = TargetCosts(),
                 draft_step_s: Mapping[int, float] | None = None):
        """costs: the target's calibrated forwards (`calibrate_target`); draft_step_s: the
        draft's (DraftClient.step_s). Without them load control has no ceiling and K per round
        starts from a linear prior."""
        self.spec = spec
        self.lending = lending  # plain rounds (and prefill without a live draft) borrow the draft's cores
        ceiling = plain_s = None
        if spec.plain_under_load and draft_step_s and costs.forwards:
            ceiling = speculation_ceiling(CostCurve.from_mapping(draft_step_s, "draft forward seconds"),
                                          CostCurve.from_mapping(costs.forwards, "target forward seconds"), spec.k)
            plain_s = CostCurve.from_mapping(costs.plain, "plain forward seconds") if costs.plain else None
        # Plain rounds' tokens/s as their forwards' seconds forecast them (one token per row).
        self.chooser = RoundChooser(ceiling=ceiling, plain=(lambda batch: batch / plain_s(batch)) if plain_s else None)
        # K per round's verify seconds by rows: the timed forwards' shape, else a linear prior.
        verify_costs = StepCostModel()
        if costs.forwards:
            verify_costs.calibrate(dict(costs.forwards))
        self.lengths = LengthChooser(spec.k, verify_costs) if spec.k_per_round and spec.mode is not Mode.AR else None
        self._draft_busy_until = 0.0  # when the draft ends the pre-speculation it began after its last reply
        self._prefill_token_s = 0.0  # the target's last prefill, seconds per token (what the draft's costs at most)
        self._last_prespec_s = 0.0

    # --- decisions ---------------------------------------------------------------------------

    def speculate(self, rows: list[Sequence]) -> bool:
        """Whether a round of these rows speculates (the draft is there): unless load control
        (SpeculativeConfig.plain_under_load) has measured plain rounds faster at this batch size.
        A seeded sampled row keeps the batch speculating: its seed promises the output of
        speculative rounds at any load."""
        return not self.spec.plain_under_load or self.seeded(rows) or self.chooser.speculate(len(rows))

    def expects_plain(self, rows: list[Sequence]) -> bool:
        """Whether a round of these rows will be plain, as load control knows it before being asked
        (`speculate` decides a round and counts it; this asks without deciding): a round that
        carries prompt pieces (TargetLoop._carries) must be plain."""
        return self.spec.plain_under_load and not self.seeded(rows) and self.chooser.expects_plain(len(rows))

    def k(self, batch: int) -> int:
        """Proposals the target verifies per row this round (the first k of the draft's K)."""
        return self.lengths.choose(batch) if self.lengths is not None else self.spec.k

    def draft_prefills_now(self, batch: int) -> bool:
        """Whether the draft prefills new sequences beside the target. Not where load control
        expects plain rounds at this batch size: the prefill then borrows the draft's cores, plain
        rounds are not held to the target's own cores while the draft prefills (under a stream of
        arrivals that halved them), and the draft learns of a sequence when it first speculates."""
        return not (self.spec.plain_under_load and self.chooser.expects_plain(batch))

    def catch_up_tokens(self, rows: list[Sequence], prefill_chunk: int) -> float:
        """Prompt tokens the draft may be sent this step for rows it has not prefilled yet: the
        step's prefill budget, all of them where a seeded sampled row would otherwise be left
        behind (its seed promises the output of speculative rounds)."""
        return float("inf") if self.seeded(rows) or not prefill_chunk else prefill_chunk

    @staticmethod
    def seeded(rows: Iterable[Sequence]) -> bool:
        return any(s.params.seeded_sampling for s in rows)

    # --- cores and the draft's busy spell ----------------------------------------------------

    def take_cores(self, plain: bool) -> None:
        """The cores of the coming forwards: the draft's too for plain ones (if lent)."""
        if self.lending is not None:
            self.lending.for_round(plain)

    def start_plain_round(self, chosen: bool, now: float) -> bool:
        """A plain round's cores; returns whether it is steady. Until the draft ends the
        pre-speculation of its last reply, its cores are busy: a round ``chosen`` while the draft
        is there that would borrow them runs on the target's own, and is not the steady rate of
        plain rounds."""
        steady = not chosen or self.lending is None or now >= self._draft_busy_until
        self.take_cores(plain=steady)
        return steady

    def start_speculative_round(self, rows: list[Sequence]) -> bool:
        """A speculative round's cores; returns whether it is steady: a row's first speculative
        rounds (after admission or plain rounds) miss, glue, and wait for pre-speculation to catch
        up."""
        steady = all(s.spec_streak >= STEADY_AFTER_ROUNDS for s in rows)
        self.take_cores(plain=False)
        return steady

    def draft_replied(self, now: float, prespec_s: float) -> None:
        """The draft answered a round: it now pre-speculates for about as long as it last did."""
        self._draft_busy_until = now + prespec_s
        self._last_prespec_s = prespec_s

    def prefilled(self, seconds: float, tokens: int, now: float, on_draft: bool) -> None:
        """The target prefilled ``tokens`` in ``seconds``; ``on_draft``: the draft prefills the
        same pieces, then pre-speculates first rounds."""
        self._prefill_token_s = seconds / tokens
        if on_draft:
            self._draft_busy_until = max(self._draft_busy_until, now + max(seconds, self._last_prespec_s))

    def draft_catching_up(self, tokens: int) -> None:
        """The draft was sent ``tokens`` prompt tokens to prefill: its cores are busy with them."""
        self._draft_busy_until = max(self._draft_busy_until, time.perf_counter() + tokens * self._prefill_token_s)

    # --- learning ----------------------------------------------------------------------------

    def observe(self, report: RoundReport | None) -> None:
        """A round's result (None: one nothing learns from, decoded without a live draft)."""
        if report is None:
            return
        if report.speculative and self.lengths is not None:
            self.lengths.observe(report.k, list(report.accepted), report.batch * (report.k + 1), report.verify_s,
                                 report.wait_s)
        # Forced tokens count: load control weighs plain rounds by what they emit.
        self.chooser.observe(report.speculative, report.batch, report.tokens, report.seconds, steady=report.steady)
