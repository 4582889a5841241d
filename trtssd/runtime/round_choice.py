"""Load control: speculate this round, or decode it plainly on the target alone?

Speculation pays at small batch and can cost at large batch, where every row of every tree step
is compute. The choice is made from what was measured here, not from a model: tokens per second
of speculative and of plain rounds, per batch size, as running averages. The faster one runs;
the slower one is tried again after a while, so a change of load or of acceptance is noticed.
Each try that confirms the choice doubles the wait before the next (up to ``max_probe_every``),
so a clear winner costs almost nothing in probes. Every path is exact, so the choice changes
speed, never the output distribution.

Two things keep the measurements honest under serving, where the batch size changes with every
arrival and departure:

- A row's first speculative rounds (just admitted, or back from plain rounds) miss, glue what
  the draft has not seen, and wait for pre-speculation to catch up: not the steady rate of
  speculation. Such *unsteady* rounds are not measured, and a try of speculation lasts until a
  steady round has been. Should unsteady rounds be all there is (a stream of arrivals), they
  count after ``max_unsteady`` in a row.
- A batch size not yet measured borrows the answer of its neighbours, because speculation's
  advantage shrinks as the batch grows: where plain rounds won at a smaller batch they win here,
  where speculation won at a larger batch it wins here. Only a size with no such evidence is
  tried, speculation first.

Switching itself costs (those unsteady rounds), so a change of batch size switches mode only for
a clear gain: the other mode must have measured ``switch_margin`` faster at the new size.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _BatchSize:
    rate: dict[bool, float] = field(default_factory=dict)  # speculative? -> tokens/s
    probe_every: int = 0  # rounds between tries of the slower mode
    since_probe: int = 0
    probing: bool = False  # trying the slower mode, until one of its rounds is measured


@dataclass
class RoundChooser:
    min_probe_every: int = 16  # rounds between tries of the slower mode, after a flip
    max_probe_every: int = 512
    decay: float = 0.7  # weight of the past in the running averages
    max_unsteady: int = 4  # unsteady rounds in a row after which they are measured
    switch_margin: float = 0.25  # how much faster the other mode must be to switch to it
    _by_batch: dict[int, _BatchSize] = field(default_factory=dict)
    _unsteady: int = 0  # unsteady rounds in a row
    _last: bool | None = None  # the mode of the last round

    def speculate(self, batch: int) -> bool:
        """True to speculate this round."""
        self._last = self._speculate(batch)
        return self._last

    def _speculate(self, batch: int) -> bool:
        b = self._entry(batch)
        if b.probing:  # a try whose rounds so far were unsteady goes on
            return self._probed_mode(batch)
        if len(b.rate) < 2:
            inferred = self._inferred(batch)
            if inferred is not None:
                return inferred
            return True not in b.rate  # unmeasured modes are tried, speculation first
        faster = self.choice(batch)
        b.since_probe += 1
        if b.since_probe >= b.probe_every:
            b.since_probe, b.probing = 0, True
            return not faster
        if self._last is not None and faster != self._last and b.rate[faster] < (1 + self.switch_margin) * b.rate[self._last]:
            return self._last  # not worth a switch
        return faster

    def observe(self, speculative: bool, batch: int, tokens: int, seconds: float, steady: bool = True) -> None:
        """One round's result. ``steady``: False for a speculative round some row of which has
        just started speculating (see the module docstring)."""
        if seconds <= 0:
            return
        self._unsteady = 0 if steady else self._unsteady + 1
        if 0 < self._unsteady < self.max_unsteady:
            return
        b = self._entry(batch)
        if b.probing and speculative != self._probed_mode(batch):
            return  # a try of the other mode is pending; this round (chosen elsewhere) is not it
        before = self.choice(batch)
        rate = tokens / seconds
        old = b.rate.get(speculative)
        b.rate[speculative] = rate if old is None or b.probing else self.decay * old + (1 - self.decay) * rate
        if b.probing:  # a try's round replaces the stale average, then backs off or resets
            b.probing = False
            b.probe_every = (self.min_probe_every if self.choice(batch) != before
                             else min(2 * b.probe_every, self.max_probe_every))

    def choice(self, batch: int) -> bool | None:
        """The mode measured faster at a batch size (True: speculate), None before both ran."""
        rate = self._by_batch.get(batch, _BatchSize()).rate
        return rate[True] >= rate[False] if len(rate) == 2 else None

    def rate(self, speculative: bool, batch: int) -> float | None:
        """Measured tokens/s of a mode at a batch size (None before any round of it)."""
        b = self._by_batch.get(batch)
        return None if b is None else b.rate.get(speculative)

    # --- helpers -----------------------------------------------------------------------------

    def _entry(self, batch: int) -> _BatchSize:
        return self._by_batch.setdefault(batch, _BatchSize(probe_every=self.min_probe_every))

    def _probed_mode(self, batch: int) -> bool:
        """The mode a pending try is for: the slower one, or the unmeasured one."""
        faster = self.choice(batch)
        return (True not in self._by_batch[batch].rate) if faster is None else not faster

    def _inferred(self, batch: int) -> bool | None:
        """The choice borrowed from measured neighbours (see the module docstring), or None."""
        smaller = [s for s in self._by_batch if s < batch and self.choice(s) is False]
        larger = [s for s in self._by_batch if s > batch and self.choice(s) is True]
        if smaller and not larger:
            return False
        if larger and not smaller:
            return True
        return None
