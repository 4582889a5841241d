"""K per round: how many of the draft's K proposals the target verifies in a speculative round.

Load control (load_control.py) decides whether a round speculates at all; this decides how far:
each round, the k in 1..K with the best predicted tokens/s at the current batch size B,

    rate(k) = B * E[tokens | k] / (verify(B * (k+1)) + wait)

from per-position acceptance, the target's verify seconds by rows and its wait for the draft,
all measured live (why, and how each term is measured: docs/design/load-control.md, "K per
round"). The target verifies the first k of the draft's K: a prefix of a speculation is a
speculation, so verification stays exact. Every ``explore_every`` rounds all K are verified, so
no position's rate goes stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trtssd.spec_decode.fanout import AcceptanceEstimator
from trtssd.spec_decode.speedup import StepCostModel, decayed

PRIOR_ACCEPTANCE = 0.7  # per position, before any evidence (the draft's own prior)
PRIOR_WEIGHT = 2.0  # positions' worth of evidence the prior counts as
ROUNDS_REMEMBERED = 50  # the acceptance's memory, in rounds of one row that verify all K


@dataclass
class LengthChooser:
    k_max: int
    verify_costs: StepCostModel = field(default_factory=StepCostModel)  # target forward seconds by rows
    explore_every: int = 16  # rounds between verifies of all K
    wait_decay: float = 0.8
    acceptance: AcceptanceEstimator = field(init=False)  # per position, from the prior (ROUNDS_REMEMBERED)
    _wait_s: float = 0.0
    _rounds: int = 0

    def __post_init__(self) -> None:
        self.acceptance = AcceptanceEstimator(PRIOR_ACCEPTANCE, PRIOR_WEIGHT, ROUNDS_REMEMBERED * self.k_max)

    def choose(self, batch: int) -> int:
        """k for this round's verify at ``batch`` rows."""
        self._rounds += 1
        if self._rounds % self.explore_every == 0:
            return self.k_max
        return max(range(1, self.k_max + 1), key=lambda k: self.predicted_rate(k, batch))

    def predicted_rate(self, k: int, batch: int) -> float:
        tokens, all_passed = 1.0, 1.0  # E[tokens | k]: the bonus, and each position where all before it passed
        for position in range(k):
            all_passed *= self.acceptance.rate(position)
            tokens += all_passed
        return batch * tokens / max(self.verify_costs.predict(batch * (k + 1)) + self._wait_s, 1e-9)

    def observe(self, k: int, accepted: list[int], verify_rows: int, verify_s: float, wait_s: float) -> None:
        """One verified round: ``k`` proposals per row, ``accepted`` per row."""
        self.acceptance.update(accepted, [k] * len(accepted))
        self.verify_costs.observe(verify_rows, verify_s)
        self._wait_s = decayed(self._wait_s, wait_s, self.wait_decay)
