"""K per round: how many of the draft's K proposals the target verifies in a speculative round.

Load control (load_control.py) decides whether a round speculates at all; this decides how far.
A longer speculation yields more tokens per round when the draft is right, and costs a verify of
B x (k+1) rows. At batch 1 the verify of K+1 rows costs about what one row does and K wins; as the
batch grows, every row of the verify is compute, and the positions the draft rarely gets right
stop paying for theirs (our serving runs: K = 7 won up to concurrency 8 and lost 9% at 16).

Each round the chooser predicts tokens/s of every k in 1..K at the current batch size from the
speedup model's two terms, measured live (docs/algorithm.md section 8):

    rate(k) = B * E[tokens | k] / (verify(B * (k+1)) + wait)

- E[tokens | k] = 1 + sum over j <= k of the probability that the first j proposals pass, from
  per-position acceptance: position i's conditional rate (it passed, given every earlier one
  did), counted over the rounds that verified it, as running sums that fade
  (`spec_decode.fanout.AcceptanceEstimator`, the estimate the draft's fan-out reads pooled).
- verify(rows): the target's forward seconds by rows (a calibrated shape, `StepCostModel`, scaled
  by every verify observed); wait: the target's wait for the draft per round, a running average.

The draft always speculates K (its cache and the q' buffers are sized for it; in ssd it works
while the target verifies), and the target verifies the first k: a prefix of a speculation is a
speculation, so verification stays exact and the draft's cache keys (accepted, bonus) still
name the outcome. Positions past the chosen k are not verified, so their rates would go stale:
every ``explore_every`` rounds all K are verified.
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
    acceptance: AcceptanceEstimator | None = None  # per position (default: the prior, ROUNDS_REMEMBERED)
    _wait_s: float = 0.0
    _rounds: int = 0

    def __post_init__(self) -> None:
        if self.acceptance is None:
            self.acceptance = AcceptanceEstimator(PRIOR_ACCEPTANCE, PRIOR_WEIGHT, ROUNDS_REMEMBERED * self.k_max)

    def choose(self, batch: int) -> int:
        """k for this round's verify at ``batch`` rows."""
        self._rounds += 1
        if self._rounds % self.explore_every == 0:
            return self.k_max
        return max(range(1, self.k_max + 1), key=lambda k: self.predicted_rate(k, batch))

    def predicted_rate(self, k: int, batch: int) -> float:
        seconds = self.verify_costs.predict(batch * (k + 1)) + self._wait_s
        return batch * self.expected_tokens(k) / max(seconds, 1e-9)

    def expected_tokens(self, k: int) -> float:
        tokens, all_passed = 1.0, 1.0
        for position in range(k):
            all_passed *= self.acceptance.rate(position)
            tokens += all_passed
        return tokens

    def observe(self, k: int, accepted: list[int], verify_rows: int, verify_s: float, wait_s: float) -> None:
        """One verified round: ``k`` proposals per row, ``accepted`` per row."""
        self.acceptance.update(accepted, [k] * len(accepted))
        self.verify_costs.observe(verify_rows, verify_s)
        self._wait_s = decayed(self._wait_s, wait_s, self.wait_decay)
