"""K per round (trtssd/runtime/k_per_round.py): the chooser picks the k with the best
predicted tokens/s from live acceptance and verify costs, explores all K now and then, and the
loop stays exact while k changes (greedy output equal to ar; the sampled law is
tests/test_exactness.py::test_proposals_verified_chosen_from_past_outcomes)."""

from __future__ import annotations

import itertools
import random

import pytest

from trtssd import SamplingParams
from trtssd.runtime.k_per_round import LengthChooser
from trtssd.spec_decode.speedup import StepCostModel


def _costs(points: dict[int, float]) -> StepCostModel:
    costs = StepCostModel()
    costs.calibrate(points)
    return costs


def _teach(chooser: LengthChooser, accepted_rate: float, rounds: int = 200) -> None:
    """Rounds of 10 rows verifying all K, where each position passes with ``accepted_rate``."""
    rng, k = random.Random(0), chooser.k_max
    for _ in range(rounds):
        rows = [next((i for i in range(k) if rng.random() >= accepted_rate), k) for _ in range(10)]
        chooser.observe(k, rows, 10 * (k + 1), chooser.verify_costs.predict(10 * (k + 1)), 0.0)


def test_flat_verify_costs_verify_every_proposal():
    chooser = LengthChooser(7, _costs({1: 0.01}), explore_every=10**6)  # one point: the same at any size
    _teach(chooser, 0.5)
    assert chooser.choose(1) == 7 and chooser.choose(16) == 7  # a longer verify costs nothing


def test_verify_costs_linear_in_rows_shorten_the_speculation_as_acceptance_falls():
    linear = {1: 0.011, 512: 0.522}  # 10 ms a forward plus 1 ms a row
    high, low = LengthChooser(7, _costs(linear), explore_every=10**6), LengthChooser(7, _costs(linear),
                                                                                       explore_every=10**6)
    _teach(high, 0.95)
    _teach(low, 0.3)
    assert high.choose(1) == 7 and 5 <= high.choose(8) < 7  # at batch 8 the 7th proposal's row costs more than it gives
    assert low.choose(8) == 1  # each extra row costs a token's time; a 30% chance does not pay for it


def test_waiting_for_the_draft_makes_longer_speculations_pay():
    chooser = LengthChooser(7, _costs({1: 0.011, 512: 0.522}), explore_every=10**6)
    _teach(chooser, 0.6)
    short = chooser.choose(1)
    for _ in range(50):
        chooser.observe(1, [1], 2, 0.002, 0.5)  # half a second of draft wait per round
    assert chooser.choose(1) > short


def test_every_position_is_verified_again_now_and_then():
    chooser = LengthChooser(5, _costs({1: 0.011, 512: 0.522}), explore_every=4)
    _teach(chooser, 0.1)
    picks = [chooser.choose(8) for _ in range(8)]
    assert picks.count(5) == 2 and set(picks) - {5} == {1}


def test_positions_past_a_rejection_are_not_counted_as_failures():
    chooser = LengthChooser(3, _costs({1: 0.01}))
    for _ in range(300):  # position 1 always passes, position 2 never, position 3 never tested
        chooser.observe(3, [1, 1], 8, 0.01, 0.0)
    rates = [chooser.acceptance.rate(i) for i in range(3)]
    assert rates[0] > 0.99 and rates[1] < 0.01 and rates[2] == pytest.approx(0.7)  # the prior stays


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_greedy_output_equals_ar_while_k_changes_every_round(tiny_llm, mode, monkeypatch):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [30, 31, 32, 33, 34], [40]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with tiny_llm(mode="ar", max_batch=4) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    cycle = itertools.cycle([1, 4, 2, 5, 3])
    monkeypatch.setattr(LengthChooser, "choose", lambda self, batch: next(cycle))
    with tiny_llm(mode=mode, k=5, max_batch=4, k_per_round=True, plain_under_load=False) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    lengths = [sum(x) for x in zip(*(o.speculation.rounds_by_length for o in outs))]
    assert all(n > 0 for n in lengths)  # rounds of every k from 1 to 5


def test_k_per_round_chooses_on_its_own_and_stays_exact(tiny_llm):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with tiny_llm(mode="ar", max_batch=2) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with tiny_llm(mode="ssd", k=4, max_batch=2, k_per_round=True, plain_under_load=False) as llm:
        assert llm.loop.policy.lengths is not None
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
