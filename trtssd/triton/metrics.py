"""The serving metrics on Triton's metrics port, through the Python backend's ``pb_utils.MetricFamily``:
the same series, names and labels as `trtssd serve`'s ``/metrics``
(trtssd/serving/prometheus_metrics.py; tests/test_triton.py checks that they stay the same),
next to Triton's own ``nv_inference_*``.

Counters are named here as prometheus_client exposes them (with ``_total``), since Triton's
exposition uses the family name as given. Every request is counted once, from its final record.
"""

from __future__ import annotations

from trtssd.serving.async_engine import FinishedRequest

# vLLM's buckets (vllm/v1/metrics/loggers.py), as trtssd/serving/prometheus_metrics.py has them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TREE_WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

# key: (exposed name, description); keys are what `observe` counts.
COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total", "Prompt tokens of finished requests."),
    "generation_tokens": ("vllm:generation_tokens_total", "Generated tokens of finished requests."),
    "num_drafts": ("vllm:spec_decode_num_drafts_total", "Verified speculation rounds (per request)."),
    "num_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified."),
    "num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted."),
    "cache_hits": ("trtssd:spec_decode_cache_hits_total", "SSD rounds answered from the speculation cache."),
    "cache_misses": ("trtssd:spec_decode_cache_misses_total", "SSD rounds answered by a backup."),
    "accepted_on_hit": ("trtssd:spec_decode_num_accepted_tokens_on_hit_total",
                        "Draft tokens accepted in rounds that hit the cache."),
    "accepted_on_miss": ("trtssd:spec_decode_num_accepted_tokens_on_miss_total",
                         "Draft tokens accepted in rounds answered by a backup."),
    "tree_branches": ("trtssd:spec_decode_tree_branches_total",
                      "Tree branches per sequence, summed over rounds (/ num_drafts = mean width)."),
    "degraded_rounds": ("trtssd:degraded_rounds_total", "Rounds decoded without the draft (lost draft: ar mode)."),
    "plain_rounds": ("trtssd:plain_rounds_total",
                     "Rounds load control decoded plainly because that measured faster."),
}
# Counters with a label of their own: key: (exposed name, description, label name).
LABELLED_COUNTERS = {
    "request_success": ("vllm:request_success_total", "Finished requests by finish reason.", "finished_reason"),
    "accepted_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                         "Draft tokens accepted at each position.", "position"),
    "backups": ("trtssd:spec_decode_backups_total", "Cache misses by the backup that answered them.", "kind"),
}
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
    "itl": ("vllm:inter_token_latency_seconds", "Time between successive streamed deltas of a request.",
            ITL_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", E2E_BUCKETS),
    "tree_width": ("trtssd:spec_decode_tree_width", "Mean tree branches per round of each request (the chosen "
                   "fan-out).", TREE_WIDTH_BUCKETS),
    "overlap": ("trtssd:overlap_efficiency", "Share of each request's rounds the target spent verifying, not "
                "waiting.", FRACTION_BUCKETS),
}
GAUGES = {
    "num_running": ("vllm:num_requests_running", "Requests in the running batch."),
    "num_waiting": ("vllm:num_requests_waiting", "Requests accepted and waiting to run."),
    "draft_degraded": ("trtssd:draft_degraded", "1 when the draft was lost and the target decodes alone (ar), else 0."),
}


def exposed_names() -> set[str]:
    """Every metric family this module exposes."""
    tables = (COUNTERS, LABELLED_COUNTERS, HISTOGRAMS, GAUGES)
    return {entry[0] for table in tables for entry in table.values()}


class TritonMetrics:
    """The metric families of one model instance. Every call is a message to the Triton server:
    call `observe` and `set_gauges` off the engine's thread."""

    def __init__(self, pb_utils, model_name: str, k: int):
        self._pb = pb_utils
        self._labels = {"model_name": model_name, "engine": "0"}  # vLLM's labels, as `trtssd serve` has them
        # The families are kept: Triton refuses updates to a metric whose family was deleted.
        self._families = {}
        self._counters = {key: self._family(name, doc, "COUNTER").Metric(labels=self._labels)
                          for key, (name, doc) in COUNTERS.items()}
        self._labelled_families = {key: (self._family(name, doc, "COUNTER"), label)
                                   for key, (name, doc, label) in LABELLED_COUNTERS.items()}
        self._labelled: dict[tuple[str, str], object] = {}
        self._histograms = {key: self._family(name, doc, "HISTOGRAM").Metric(labels=self._labels, buckets=list(b))
                            for key, (name, doc, b) in HISTOGRAMS.items()}
        self._gauges = {key: self._family(name, doc, "GAUGE").Metric(labels=self._labels)
                        for key, (name, doc) in GAUGES.items()}
        self._gauge_values: dict[str, float] = {}
        for position in range(k):  # every series exists from the start, as on `trtssd serve`
            self._labelled_metric("accepted_per_pos", str(position))
        for kind in ("neural", "fast"):
            self._labelled_metric("backups", kind)

    def observe(self, record: FinishedRequest) -> None:
        """Count one finished request."""
        m = record.spec
        self._add("prompt_tokens", record.prompt_tokens)
        self._add("generation_tokens", record.completion_tokens)
        self._labelled_metric("request_success", record.finish_reason).increment(1)
        if record.ttft_s is not None:
            self._histograms["ttft"].observe(record.ttft_s)
        for gap in record.token_gaps_s:
            self._histograms["itl"].observe(gap)
        self._histograms["e2e"].observe(record.e2e_s)
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "cache_hits", "cache_misses",
                    "accepted_on_hit", "accepted_on_miss", "tree_branches", "degraded_rounds", "plain_rounds"):
            self._add(key, getattr(m, key))
        for position, accepted in enumerate(m.accepted_per_position):
            if accepted:
                self._labelled_metric("accepted_per_pos", str(position)).increment(accepted)
        for kind, count in (("neural", m.neural_backups), ("fast", m.fast_backups)):
            if count:
                self._labelled_metric("backups", kind).increment(count)
        if m.tree_branches:  # SSD rounds only (sd has no tree)
            self._histograms["tree_width"].observe(m.tree_branches / m.num_drafts)
        if m.round_time_s > 0:
            self._histograms["overlap"].observe(m.verify_time_s / m.round_time_s)

    def set_gauges(self, num_running: int, num_waiting: int, draft_degraded: bool) -> None:
        """Set the gauges (only those that changed: each set is a message to the server)."""
        for key, value in (("num_running", num_running), ("num_waiting", num_waiting),
                           ("draft_degraded", float(draft_degraded))):
            if self._gauge_values.get(key) != value:
                self._gauges[key].set(value)
                self._gauge_values[key] = value

    def close(self) -> None:
        """Drop the metrics, then their families (Triton wants that order)."""
        self._counters.clear()
        self._labelled.clear()
        self._histograms.clear()
        self._gauges.clear()
        self._labelled_families.clear()
        self._families.clear()

    def _family(self, name: str, doc: str, kind: str):
        family = self._pb.MetricFamily
        self._families[name] = family(name=name, description=doc, kind=getattr(family, kind))
        return self._families[name]

    def _add(self, key: str, amount: float) -> None:
        if amount:
            self._counters[key].increment(amount)

    def _labelled_metric(self, key: str, value: str):
        metric = self._labelled.get((key, value))
        if metric is None:
            family, label = self._labelled_families[key]
            metric = self._labelled[(key, value)] = family.Metric(labels={**self._labels, label: value})
        return metric
