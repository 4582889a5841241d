"""The serving metrics, defined once: each family's name, description, kind, buckets and label of its
own, and what one finished request adds to them. `trtssd serve`'s ``/metrics``
(trtssd/serving/prometheus_metrics.py, prometheus_client) and Triton's metrics port
(trtssd/triton/metrics.py, ``pb_utils.MetricFamily``) both build their families from `METRICS` and
apply `request_additions`, so the two expose the same series with the same values.

Names are vLLM's where vLLM has them (so its dashboards work) and ``trtssd:`` for what only SSD has.
Every series also carries vLLM's labels ``model_name`` and ``engine`` (`LABELS`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from trtssd.config import Source
from trtssd.text.output_processor import RequestOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TREE_WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
LENGTH_BUCKETS = tuple(range(1, 17))  # k is at most 16
FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

LABELS = ("model_name", "engine")  # vLLM's, on every series
ENGINE_INDEX = "0"  # the ``engine`` label: one engine per server
# Misses by the backup that answered them: (label value, SpeculationMetrics field).
BACKUPS = ((Source.NEURAL.value, "neural_backups"), (Source.FAST.value, "fast_backups"))


class Kind(enum.Enum):
    """A family's kind; the values are the names of ``pb_utils.MetricFamily``'s constants."""

    COUNTER = "COUNTER"
    GAUGE = "GAUGE"
    HISTOGRAM = "HISTOGRAM"


@dataclass(frozen=True)
class MetricDef:
    key: str  # how `request_additions` and the exporters refer to it
    name: str  # the family name as prometheus_client takes it: a counter's without ``_total``
    doc: str
    kind: Kind
    label: str | None = None  # a label of its own, besides `LABELS`
    buckets: tuple[float, ...] = ()  # histograms only

    @property
    def exposed_name(self) -> str:
        """The family name a scrape shows. prometheus_client appends ``_total`` to a counter's
        name; Triton shows the name it was given, so it is given this one."""
        return self.name + "_total" if self.kind is Kind.COUNTER else self.name


def _counter(key: str, name: str, doc: str, label: str | None = None) -> MetricDef:
    return MetricDef(key, name, doc, Kind.COUNTER, label)


def _histogram(key: str, name: str, doc: str, buckets: tuple[float, ...]) -> MetricDef:
    return MetricDef(key, name, doc, Kind.HISTOGRAM, buckets=buckets)


def _gauge(key: str, name: str, doc: str) -> MetricDef:
    return MetricDef(key, name, doc, Kind.GAUGE)


# In exposition order (prometheus_client exposes families in the order they are registered).
METRICS = (
    # vLLM: requests and tokens
    _counter("prompt_tokens", "vllm:prompt_tokens", "Prompt tokens of finished requests."),
    _counter("generation_tokens", "vllm:generation_tokens", "Generated tokens of finished requests."),
    _counter("request_success", "vllm:request_success", "Finished requests by finish reason.", "finished_reason"),
    # vLLM: prefix caching (token counts, as vLLM counts them)
    _counter("prefix_cache_queries", "vllm:prefix_cache_queries", "Prompt tokens of finished requests, looked up in "
             "the prefix cache."),
    _counter("prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens the target's prefix cache gave (not "
             "prefilled)."),
    _histogram("ttft", "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
    _histogram("itl", "vllm:inter_token_latency_seconds", "Time between successive streamed deltas of a request.",
               ITL_BUCKETS),
    _histogram("e2e", "vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", E2E_BUCKETS),
    # vLLM: speculative decoding (vllm/v1/spec_decode/metrics.py)
    _counter("num_drafts", "vllm:spec_decode_num_drafts", "Verified speculation rounds (per request)."),
    _counter("num_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Draft tokens verified."),
    _counter("num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    _counter("accepted_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos",
             "Draft tokens accepted at each position.", "position"),
    # trtssd: what only SSD has
    _counter("cache_hits", "trtssd:spec_decode_cache_hits", "SSD rounds answered from the speculation cache."),
    _counter("cache_misses", "trtssd:spec_decode_cache_misses", "SSD rounds answered by a backup."),
    _counter("accepted_on_hit", "trtssd:spec_decode_num_accepted_tokens_on_hit",
             "Draft tokens accepted in rounds that hit the cache."),
    _counter("accepted_on_miss", "trtssd:spec_decode_num_accepted_tokens_on_miss",
             "Draft tokens accepted in rounds answered by a backup."),
    _counter("backups", "trtssd:spec_decode_backups", "Cache misses by the backup that answered them.", "kind"),
    _counter("tree_branches", "trtssd:spec_decode_tree_branches",
             "Tree branches per sequence, summed over rounds (/ num_drafts = the mean fan-out budget used)."),
    _histogram("spec_length", "trtssd:spec_decode_num_verified_drafts",
               "Proposals verified per round of each request (K, or K per round's choice).", LENGTH_BUCKETS),
    _histogram("tree_width", "trtssd:spec_decode_tree_width",
               "Mean tree branches per round of each request: the fan-out budget chosen (a dashboard name, kept).", TREE_WIDTH_BUCKETS),
    _histogram("overlap", "trtssd:overlap_efficiency",
               "Share of each request's rounds the target spent verifying, not waiting.", FRACTION_BUCKETS),
    _counter("draft_prefix_cache_queries", "trtssd:draft_prefix_cache_queries",
             "Prompt tokens of finished requests the draft speculated for, looked up in its prefix cache."),
    _counter("draft_prefix_cache_hits", "trtssd:draft_prefix_cache_hits",
             "Prompt tokens the draft rank's prefix cache gave it (not prefilled there)."),
    _counter("degraded_rounds", "trtssd:degraded_rounds", "Rounds decoded without the draft (lost draft: ar mode)."),
    _counter("plain_rounds", "trtssd:plain_rounds",
             "Rounds load control decoded plainly because that measured faster."),
    _counter("spare_row_guesses", "trtssd:spare_row_guesses",
             "Plain rounds of one row that verified an n-gram guess in the row its forward carries anyway."),
    _counter("spare_row_guesses_accepted", "trtssd:spare_row_guesses_accepted",
             "Spare-row guesses accepted: two tokens from one forward."),
    _counter("grammar_rounds", "trtssd:structured_output_forced_rounds",
             "Rows' rounds that verified the tokens a constraint's grammar forced (structured outputs)."),
    _counter("grammar_proposed_tokens", "trtssd:structured_output_forced_tokens",
             "Tokens a constraint's grammar forced and proposed (verified like a draft's proposals)."),
    _counter("grammar_accepted_tokens", "trtssd:structured_output_forced_accepted_tokens",
             "Forced tokens accepted and emitted."),
    _counter("grammar_mask_time_s", "trtssd:structured_output_mask_seconds",
             "Seconds the target spent computing constraints' token masks (every position of every chain)."),
    # gauges, read from the engine rather than from finished requests
    _gauge("num_running", "vllm:num_requests_running", "Requests in the running batch."),
    _gauge("num_waiting", "vllm:num_requests_waiting", "Requests accepted and waiting to run."),
    _gauge("draft_degraded", "trtssd:draft_degraded",
           "1 when the draft was lost and the target decodes alone (ar), else 0."),
)

# Unlabelled counters that are the sum of the SpeculationMetrics field of the same name.
_SPEC_TOTALS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "cache_hits", "cache_misses",
                "accepted_on_hit", "accepted_on_miss", "tree_branches", "degraded_rounds", "plain_rounds",
                "spare_row_guesses", "spare_row_guesses_accepted", "grammar_rounds", "grammar_proposed_tokens", "grammar_accepted_tokens", "grammar_mask_time_s")


def series_from_start(k: int) -> tuple[tuple[str, str], ...]:
    """(key, label value) of the labelled series made before anything is counted, so a dashboard
    reads 0 rather than no data: every draft position, and both backups."""
    positions = tuple(("accepted_per_pos", str(position)) for position in range(k))
    return positions + tuple(("backups", kind) for kind, _ in BACKUPS)


@dataclass(frozen=True)
class RequestAdditions:
    """What one finished request adds. Zero increments are left out: on Triton each is a message
    to the server, and every series they would touch exists already or stays absent either way."""

    # (counter key, the value of its own label, None for a counter without one) -> increment
    increments: dict[tuple[str, str | None], float]
    observations: tuple[tuple[str, float], ...]  # (histogram key, value), in order


def request_additions(record: RequestOutput) -> RequestAdditions:
    m = record.speculation
    increments = {("prompt_tokens", None): record.prompt_tokens, ("generation_tokens", None): record.completion_tokens,
                  ("request_success", record.finish_reason): 1, ("prefix_cache_queries", None): record.prompt_tokens,
                  ("prefix_cache_hits", None): record.num_cached_tokens,
                  ("draft_prefix_cache_queries", None): m.draft_prompt_tokens,
                  ("draft_prefix_cache_hits", None): m.draft_cached_tokens}
    increments.update(((key, None), getattr(m, key)) for key in _SPEC_TOTALS)
    increments.update((("accepted_per_pos", str(p)), n) for p, n in enumerate(m.accepted_per_position))
    increments.update((("backups", kind), getattr(m, field)) for kind, field in BACKUPS)
    return RequestAdditions(increments={series: n for series, n in increments.items() if n},
                            observations=_observations(record))


def _observations(record: RequestOutput) -> tuple[tuple[str, float], ...]:
    m = record.speculation
    out = [] if record.ttft_s is None else [("ttft", record.ttft_s)]  # None: aborted before its first token
    out += [("itl", gap) for gap in record.token_gaps_s]
    out.append(("e2e", record.e2e_s))
    out += [("spec_length", k) for k, rounds in enumerate(m.rounds_by_length, start=1) for _ in range(rounds)]
    if m.tree_branches:  # SSD rounds only (sd has no tree)
        out.append(("tree_width", m.tree_branches / m.num_drafts))
    if m.round_time_s > 0:
        out.append(("overlap", m.verify_time_s / m.round_time_s))
    return tuple(out)
