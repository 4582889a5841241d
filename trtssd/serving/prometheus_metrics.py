"""Prometheus metrics of one server, under vLLM's names where vLLM has them (so its dashboards
work) and ``trtssd:`` for what only SSD has.

Everything is counted from the final records of the requests the server actually served (each
request's own `SpecMetrics`), once per request, when it ends; gauges are read from the engine at
scrape time. Every metric carries vLLM's labels ``model_name`` and ``engine``. Each server has
its own `CollectorRegistry`, so several servers in one process do not clash.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from trtssd.config import Mode
from trtssd.serving.async_engine import AsyncEngine, FinishedRequest

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TREE_WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST  # of exposition()
LABELS = ("model_name", "engine")


class ServerMetrics:
    def __init__(self, model_name: str, k: int):
        self.registry = CollectorRegistry()
        self._labels = (model_name, "0")
        r = self.registry  # for the metrics with labels of their own
        # vLLM: requests and tokens
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens of finished requests.")
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       LABELS + ("finished_reason",), registry=r)
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = self._histogram("vllm:inter_token_latency_seconds",
                                   "Time between successive streamed deltas of a request.", ITL_BUCKETS)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                                   E2E_BUCKETS)
        # vLLM: speculative decoding (vllm/v1/spec_decode/metrics.py)
        self.num_drafts = self._counter("vllm:spec_decode_num_drafts", "Verified speculation rounds (per request).")
        self.num_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted = self._counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each position.", LABELS + ("position",), registry=r)
        for position in range(k):  # every position's series exists from the start
            self.accepted_per_pos.labels(*self._labels, str(position))
        # trtssd: what only SSD has
        self.cache_hits = self._counter("trtssd:spec_decode_cache_hits",
                                        "SSD rounds answered from the speculation cache.")
        self.cache_misses = self._counter("trtssd:spec_decode_cache_misses", "SSD rounds answered by a backup.")
        self.accepted_on_hit = self._counter("trtssd:spec_decode_num_accepted_tokens_on_hit",
                                             "Draft tokens accepted in rounds that hit the cache.")
        self.accepted_on_miss = self._counter("trtssd:spec_decode_num_accepted_tokens_on_miss",
                                              "Draft tokens accepted in rounds answered by a backup.")
        self.backups = Counter("trtssd:spec_decode_backups", "Cache misses by the backup that answered them.",
                               LABELS + ("kind",), registry=r)
        for kind in ("neural", "fast"):
            self.backups.labels(*self._labels, kind)
        self.tree_branches = self._counter("trtssd:spec_decode_tree_branches",
                                           "Tree branches per sequence, summed over rounds "
                                           "(/ num_drafts = mean width).")
        self.tree_width = self._histogram("trtssd:spec_decode_tree_width",
                                          "Mean tree branches per round of each request (the chosen fan-out).",
                                          TREE_WIDTH_BUCKETS)
        self.overlap = self._histogram("trtssd:overlap_efficiency",
                                       "Share of each request's rounds the target spent verifying, not waiting.",
                                       FRACTION_BUCKETS)
        self.degraded_rounds = self._counter("trtssd:degraded_rounds",
                                             "Rounds decoded without the draft (lost draft: ar mode).")
        self.plain_rounds = self._counter("trtssd:plain_rounds",
                                          "Rounds load control decoded plainly because that measured faster.")
        self.num_running = self._gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = self._gauge("vllm:num_requests_waiting", "Requests accepted and waiting to run.")
        self.draft_degraded = self._gauge("trtssd:draft_degraded",
                                          "1 when the draft was lost and the target decodes alone (ar), else 0.")

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, LABELS, registry=self.registry).labels(*self._labels)

    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, LABELS, registry=self.registry).labels(*self._labels)

    def _histogram(self, name: str, doc: str, buckets):
        return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*self._labels)

    def track(self, engine: AsyncEngine) -> None:
        """Read the gauges from ``engine`` at each scrape."""
        speculative = engine.loop.spec.mode is not Mode.AR
        self.num_running.set_function(lambda: engine.num_running)
        self.num_waiting.set_function(lambda: engine.num_waiting)
        self.draft_degraded.set_function(lambda: float(speculative and not engine.loop.speculating))

    def observe(self, record: FinishedRequest) -> None:
        """Count one finished request (called by the engine thread as it ends)."""
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.completion_tokens)
        self.request_success.labels(*self._labels, record.finish_reason).inc()
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
        for gap in record.token_gaps_s:
            self.itl.observe(gap)
        self.e2e.observe(record.e2e_s)
        self._observe_speculation(record)

    def _observe_speculation(self, record: FinishedRequest) -> None:
        m = record.spec
        self.num_drafts.inc(m.num_drafts)
        self.num_draft_tokens.inc(m.num_draft_tokens)
        self.num_accepted.inc(m.num_accepted_tokens)
        for position, accepted in enumerate(m.accepted_per_position):
            self.accepted_per_pos.labels(*self._labels, str(position)).inc(accepted)
        self.cache_hits.inc(m.cache_hits)
        self.cache_misses.inc(m.cache_misses)
        self.accepted_on_hit.inc(m.accepted_on_hit)
        self.accepted_on_miss.inc(m.accepted_on_miss)
        self.backups.labels(*self._labels, "neural").inc(m.neural_backups)
        self.backups.labels(*self._labels, "fast").inc(m.fast_backups)
        self.tree_branches.inc(m.tree_branches)
        self.degraded_rounds.inc(m.degraded_rounds)
        self.plain_rounds.inc(m.plain_rounds)
        if m.tree_branches:  # SSD rounds only (sd has no tree)
            self.tree_width.observe(m.tree_branches / m.num_drafts)
        if m.round_time_s > 0:
            self.overlap.observe(m.verify_time_s / m.round_time_s)

    def exposition(self) -> bytes:
        """The text format served at GET /metrics."""
        return generate_latest(self.registry)
