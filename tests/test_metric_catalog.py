"""The metric catalog: what one finished request adds (tests/test_triton.py checks that both
exporters end up with the same totals from it)."""

from __future__ import annotations

from request_records import finished
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.text.output_processor import RequestOutput
from trtssd.serving.metric_catalog import METRICS, Kind, request_additions, series_from_start


def _ssd_request() -> RequestOutput:
    spec = SpeculationMetrics(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4, accepted_per_position=[2, 2, 0],
                       cache_hits=1, cache_misses=1, accepted_on_hit=3, accepted_on_miss=1, fast_backups=1,
                       tree_branches=5, round_time_s=2.0, verify_time_s=1.5, rounds_by_length=[0, 0, 2],
                       draft_cached_tokens=4)
    return finished("r", 7, (1, 2, 3), "abc", "stop", 0.1, 0.9, (0.2, 0.3), spec)


def _aborted_request() -> RequestOutput:
    return finished("a", 3, (), "", "abort", None, 0.05, (), SpeculationMetrics())


def test_one_request_adds_its_counts_and_no_zeros():
    additions = request_additions(_ssd_request())
    unlabelled = {"prompt_tokens": 7, "generation_tokens": 3, "num_drafts": 2, "num_draft_tokens": 6,
                  "num_accepted_tokens": 4, "cache_hits": 1, "cache_misses": 1, "accepted_on_hit": 3,
                  "accepted_on_miss": 1, "tree_branches": 5, "prefix_cache_queries": 7, "draft_prefix_cache_hits": 4}
    labelled = {("request_success", "stop"): 1, ("accepted_per_pos", "0"): 2, ("accepted_per_pos", "1"): 2,
                ("backups", "fast"): 1}  # position 2 and the neural backup: zero, left out
    assert additions.increments == {**{(key, None): n for key, n in unlabelled.items()}, **labelled}
    assert additions.observations == (("ttft", 0.1), ("itl", 0.2), ("itl", 0.3), ("e2e", 0.9), ("spec_length", 3),
                                      ("spec_length", 3), ("tree_width", 2.5), ("overlap", 0.75))


def test_an_aborted_request_without_rounds_adds_only_what_it_has():
    additions = request_additions(_aborted_request())
    assert additions.increments == {("prompt_tokens", None): 3, ("request_success", "abort"): 1,
                                    ("prefix_cache_queries", None): 3}
    assert additions.observations == (("e2e", 0.05),)  # no ttft, no tree, no rounds to overlap


def test_every_key_is_a_catalog_entry_of_the_right_kind():
    kinds = {d.key: (d.kind, d.label) for d in METRICS}
    additions = request_additions(_ssd_request())
    # a label value exactly where the counter has a label of its own
    assert all(kinds[key][0] is Kind.COUNTER and (kinds[key][1] is None) == (value is None)
               for key, value in additions.increments)
    assert all(kinds[key] == (Kind.HISTOGRAM, None) for key, _ in additions.observations)
    assert series_from_start(2) == (("accepted_per_pos", "0"), ("accepted_per_pos", "1"), ("backups", "neural"),
                                    ("backups", "fast"))
