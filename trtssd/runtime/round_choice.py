"""Load control: speculate this round, or decode it plainly on the target alone?

Speculation pays at small batch and can cost at large batch, where every row of every tree step
is compute. The choice is made from what was measured here, not from a model: tokens per second
of speculative and of plain rounds, per batch size, as running averages. The faster one runs;
the slower one is tried again after a while, so a change of load or of acceptance is noticed.
Each try that confirms the choice doubles the wait before the next (up to ``max_probe_every``),
so a clear winner costs almost nothing in probes. Every path is exact, so the choice changes
speed, never the output distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _BatchSize:
    rate: dict[bool, float] = field(default_factory=dict)  # speculative? -> tokens/s
    probe_every: int = 0  # rounds between tries of the slower mode
    since_probe: int = 0
    probing: bool = False  # this round tries the slower mode


@dataclass
class RoundChooser:
    min_probe_every: int = 16  # rounds between tries of the slower mode, after a flip
    max_probe_every: int = 512
    decay: float = 0.7  # weight of the past in the running averages
    _by_batch: dict[int, _BatchSize] = field(default_factory=dict)

    def speculate(self, batch: int) -> bool:
        """True to speculate this round. Unmeasured modes are tried first, speculation first."""
        b = self._by_batch.setdefault(batch, _BatchSize(probe_every=self.min_probe_every))
        if True not in b.rate:
            return True
        if False not in b.rate:
            return False
        faster = b.rate[True] >= b.rate[False]
        b.since_probe += 1
        b.probing = b.since_probe >= b.probe_every
        if b.probing:
            b.since_probe = 0
            return not faster
        return faster

    def observe(self, speculative: bool, batch: int, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        b = self._by_batch.setdefault(batch, _BatchSize(probe_every=self.min_probe_every))
        before = self.choice(batch)
        rate = tokens / seconds
        old = b.rate.get(speculative)
        b.rate[speculative] = rate if old is None or b.probing else self.decay * old + (1 - self.decay) * rate
        if b.probing:  # a probe's single round replaces the stale average, then backs off or resets
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
