"""Load control: speculate this round, or decode it plainly on the target alone?

Speculation pays at small batch and can cost at large batch, where every row of every tree step
is compute. The choice is made from what was measured here, not from a model: tokens per second
of speculative and of plain rounds, per batch size, as running averages. The faster one runs;
the slower one is tried again after a while, so a change of load or of acceptance is noticed.
Each try that confirms the choice doubles the wait before the next (up to ``max_probe_every``).
Every path is exact, so the choice changes speed, never the output distribution.

How tries are measured and bounded, which rounds are not measured (*unsteady*), what a batch size
borrows from its neighbours, and speculation's ceiling: docs/design/load-control.md, "How the
choice is made".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from trtssd.spec_decode.speedup import decayed

log = logging.getLogger(__name__)


def speculation_ceiling(draft_s: Callable[[int], float], target_s: Callable[[int], float],
                        k: int) -> Callable[[int], float]:
    """batch -> the most tokens/s speculation can give, from the seconds of a draft forward and of
    a target forward by the rows they hold. A round yields at most K+1 tokens per row; it takes at
    least the verify (a target forward of K+1 rows per sequence, on the target's own cores) and at
    least K draft forwards of the batch's rows (K chain steps in sd; in ssd a hit's round waits for
    the pre-speculation's glue and K tree steps of at least as many rows), which run at once in
    ssd. (A miss answered by the fast backup drafts nothing, but its proposals are rarely accepted.)"""
    return lambda batch: batch * (k + 1) / max(k * draft_s(batch), target_s(batch * (k + 1)))


@dataclass
class _Rate:
    """Running sums of one choice's rounds: tokens / seconds is its rate."""

    tokens: float
    seconds: float

    @property
    def value(self) -> float:
        return self.tokens / self.seconds


@dataclass
class _BatchSize:
    rates: dict[bool, _Rate] = field(default_factory=dict)  # speculative? -> its rate
    probe_every: int = 0  # rounds between tries of the slower choice
    since_probe: int = 0
    choice: bool | None = None  # the choice decided here (True: speculation); None before both ran
    trying: bool | None = None  # the choice a pending try runs
    try_left: int = 0  # rows the try still needs measured
    try_spent: int = 0  # rounds the try has run, measured or not
    try_s: dict[bool, float] = field(default_factory=dict)  # choice -> seconds its pending (or last) try ran, every round
    since_probe_s: float = 0.0  # seconds of the decided choice since the last try
    ruled_out: bool = False  # plain rounds measured at speculation's ceiling (see _ruled_out)
    try_cost_s: float = 0.0  # what the pending (or last) try of speculation cost (RoundChooser._charge_try)


@dataclass
class RoundChooser:
    min_probe_every: int = 16  # rounds between tries of the slower choice, after a flip
    max_probe_every: int = 512
    decay: float = 0.8  # weight of the past in the running sums
    speculative_try_rows: int = 4  # rows measured in a try of speculation
    plain_try_rows: int = 8  # rows measured in a try of plain rounds
    max_unsteady: int = 4  # unsteady rounds in a row after which they are measured
    switch_margin: float = 0.25  # how much faster the other choice must be to switch to it on a batch change
    quiet_per_try: float = 9.0  # seconds of the decided choice before the next try, per second of the last
    max_try_share: float = 0.1  # most of the rounds' seconds that tries of speculation take (plus one round)
    ceiling: Callable[[int], float] | None = None  # batch -> speculation's best tokens/s (speculation_ceiling)
    plain: Callable[[int], float] | None = None  # batch -> plain rounds' tokens/s forecast from calibrated forwards
    _by_batch: dict[int, _BatchSize] = field(default_factory=dict)
    _rounds_s: float = 0.0  # seconds of every round observed
    _tries_cost_s: float = 0.0  # what tries of speculation cost (seconds beyond plain rounds')
    _last_try_cost_s: float = 0.0  # what the last try of speculation cost
    _unsteady: int = 0  # unsteady rounds in a row
    _last: bool | None = None  # the choice of the last round
    _last_batch: int | None = None  # the batch size of the last round

    def speculate(self, batch: int) -> bool:
        """True to speculate this round."""
        self._last = self._speculate(batch)
        self._last_batch = batch
        return self._last

    def _speculate(self, batch: int) -> bool:
        b = self._entry(batch)
        if b.trying and self._tries_cost_s > self.max_try_share * self._rounds_s:
            log.debug("batch %d: a try of speculation outgrew its share of the time: ended", batch)
            self._end_try(b, batch)
            self._last_try_cost_s *= 2  # unfinished: the next try waits for more room than it had
        if b.choice is None and b.trying is None and self._ruled_out(b, batch):
            b.choice = False  # the costs rule speculation out: no try
        if b.choice is None:  # not measured here yet: the neighbours' answer, else plain rounds' try
            inferred = self._inferred(batch)
            if inferred is not None:
                b.trying = None  # rounds of the borrowed choice measure it here meanwhile
                return inferred
            if b.trying is None:
                self._start_try(b, False)
        if b.trying is not None:
            b.try_spent += 1
            # A try goes on until its rounds are measured; under a stream of arrivals they may
            # never be steady, and a try of the slower choice must not run for good.
            # A try of plain rounds waits out the draft's busy spell, which is bounded.
            measured_rounds = -(-self._try_rows(b.trying) // batch)
            if b.try_spent <= measured_rounds + self.max_unsteady or b.choice is None or not b.trying:
                return b.trying
            self._end_try(b, batch)
        b.since_probe += 1
        if b.since_probe >= b.probe_every and b.since_probe_s >= self.quiet_per_try * b.try_s.get(not b.choice, 0.0):
            b.since_probe, b.since_probe_s = 0, 0.0
            if b.choice or (not self._ruled_out(b, batch) and self._try_fits()):
                return self._start_try(b, not b.choice)
        if self._clearly_faster(b, not b.choice):  # the load changed since the last try
            b.choice, b.probe_every = not b.choice, self.min_probe_every
        if batch != self._last_batch and self._last is not None and not self._clearly_faster(b, b.choice, self._last):
            return self._last  # an arrival or a departure: not worth a switch
        return b.choice

    def observe(self, speculative: bool, batch: int, tokens: int, seconds: float, steady: bool = True) -> None:
        """One round's result. ``steady``: False for a speculative round some row of which has
        just started speculating (docs/design/load-control.md)."""
        if seconds <= 0:
            return
        b = self._entry(batch)
        self._rounds_s += seconds
        if b.trying is None:
            b.since_probe_s += seconds
        else:  # a try's rounds, the other choice's among them (a try of speculation catching up)
            b.try_s[b.trying] += seconds
            if b.trying:
                self._charge_try(b, batch, tokens, seconds)
        if not speculative and not steady:
            return  # the draft's cores were busy: its spell ends by itself, so never measured
        self._unsteady = 0 if steady else self._unsteady + 1
        if 0 < self._unsteady < self.max_unsteady:
            return
        if b.trying is not None and speculative != b.trying:
            return  # a try of the other choice is pending; this round (chosen elsewhere) is not it
        rate = b.rates.get(speculative)
        if b.trying is None:  # the decided choice, or one borrowed from the neighbours
            if rate is None:
                b.rates[speculative] = _Rate(tokens, seconds)
            else:
                rate.tokens = decayed(rate.tokens, tokens, self.decay)
                rate.seconds = decayed(rate.seconds, seconds, self.decay)
            if b.choice is None and len(b.rates) == 2:
                b.choice = b.rates[True].value >= b.rates[False].value
            return
        if b.try_left == self._try_rows(speculative) or rate is None:  # a try's first round: the stale sums go
            b.rates[speculative] = _Rate(tokens, seconds)
        else:  # a try sums its rounds, unweighted
            rate.tokens += tokens
            rate.seconds += seconds
        b.try_left -= batch
        if b.try_left <= 0:
            self._end_try(b, batch)

    def choice(self, batch: int) -> bool | None:
        """The choice decided at a batch size (True: speculate), None before both were tried."""
        b = self._by_batch.get(batch)
        return None if b is None else b.choice

    def expects_plain(self, batch: int) -> bool:
        """Whether rounds at a batch size will be plain for now: decided so there, a try of plain
        rounds pending or due first (a new batch size tries them first), or borrowed from a
        neighbour that decided so."""
        b = self._by_batch.get(batch)
        if b is not None and b.choice is not None:
            return b.choice is False
        if b is not None and b.trying is not None:
            return not b.trying
        inferred = self._inferred(batch)
        return True if inferred is None else not inferred

    # --- helpers -----------------------------------------------------------------------------

    def _entry(self, batch: int) -> _BatchSize:
        return self._by_batch.setdefault(batch, _BatchSize(probe_every=self.min_probe_every))

    def _clearly_faster(self, b: _BatchSize, choice: bool, than: bool | None = None) -> bool:
        """Whether ``choice`` measured ``switch_margin`` faster than ``than`` (the other choice). A
        choice never measured here (speculation ruled out by its ceiling) is slower than any."""
        than = (not choice) if than is None else than
        if choice == than or choice not in b.rates:
            return False
        return than not in b.rates or b.rates[choice].value > (1 + self.switch_margin) * b.rates[than].value

    def _try_fits(self) -> bool:
        """Whether a try of speculation that costs what the last one did keeps tries within
        ``max_try_share`` of the rounds' seconds."""
        cost = self._last_try_cost_s
        return self._tries_cost_s + cost <= self.max_try_share * (self._rounds_s + cost)

    def _charge_try(self, b: _BatchSize, batch: int, tokens: int, seconds: float) -> None:
        """Add a round of a try of speculation to what tries cost: its seconds beyond what plain
        rounds (as measured here, else as forecast) would have taken for its tokens; all of
        them where neither is known. A round faster than plain ones earns back what the try's
        earlier rounds cost, never more."""
        plain = b.rates[False].value if False in b.rates else self.plain(batch) if self.plain is not None else None
        cost = seconds - (tokens / plain if plain else 0.0)
        self._tries_cost_s = max(0.0, self._tries_cost_s + cost)
        b.try_cost_s = max(0.0, b.try_cost_s + cost)

    def _ruled_out(self, b: _BatchSize, batch: int) -> bool:
        """Whether speculation cannot beat plain rounds at this batch size: as measured there, or
        as forecast before they were. Once ruled out it stays so until plain rounds fall
        ``switch_margin`` below the ceiling: their rate wanders with the cache's length, and the
        ceiling is rarely reached."""
        if self.ceiling is None:
            return False
        if False in b.rates:
            plain, source = b.rates[False].value, "measured"
        elif self.plain is not None:
            plain, source = self.plain(batch), "forecast"
        else:
            return False
        ceiling = self.ceiling(batch)
        ruled_out = plain * (1 + self.switch_margin if b.ruled_out else 1) >= ceiling
        if ruled_out and not b.ruled_out:
            log.info("batch %d: plain rounds give %.1f tokens/s (%s), above the %.1f speculation can give "
                     "with these forward costs: not tried", batch, plain, source, ceiling)
        b.ruled_out = ruled_out
        return ruled_out

    def _try_rows(self, speculative: bool) -> int:
        """Rows a try of a choice measures."""
        return self.speculative_try_rows if speculative else self.plain_try_rows

    def _start_try(self, b: _BatchSize, speculative: bool) -> bool:
        b.trying, b.try_left, b.try_spent = speculative, self._try_rows(speculative), 0
        b.try_s[speculative], b.try_cost_s = 0.0, 0.0
        return speculative

    def _end_try(self, b: _BatchSize, batch: int) -> None:
        """Decide with what the try measured; back off when it confirmed the choice. Plain rounds
        hold until speculation has measured faster (its try comes as any other, or never where
        its ceiling rules it out)."""
        tried, b.trying = b.trying, None
        if tried:
            self._last_try_cost_s = b.try_cost_s
        log.debug("batch %d: a try ended; tokens/s speculative %s, plain %s, ceiling %s", batch,
                  *(f"{b.rates[m].value:.1f}" if m in b.rates else None for m in (True, False)),
                  None if self.ceiling is None else f"{self.ceiling(batch):.1f}")
        if True not in b.rates:  # plain rounds' first try, or a try of speculation that measured nothing
            b.choice = False
            if tried:
                b.probe_every = min(2 * b.probe_every, self.max_probe_every)
            else:
                b.since_probe = b.probe_every  # speculation's first try is due next (where it fits)
        elif len(b.rates) == 2:
            before, b.choice = b.choice, b.rates[True].value >= b.rates[False].value
            b.probe_every = (min(2 * b.probe_every, self.max_probe_every) if b.choice == before
                             else self.min_probe_every)

    def _inferred(self, batch: int) -> bool | None:
        """The choice borrowed from measured neighbours (docs/design/load-control.md), or None."""
        plain_below = any(s < batch and self.choice(s) is False for s in self._by_batch)
        speculative_above = any(s > batch and self.choice(s) is True for s in self._by_batch)
        return None if plain_below == speculative_above else speculative_above  # none, or contradicting
