"""Prometheus metrics of one server: the families of trtssd/serving/metric_catalog.py, through
prometheus_client, served at ``/metrics`` by `trtssd serve`.

Everything is counted from the final records of the requests the server actually served (each
request's own `SpeculationMetrics`), once per request, when it ends; gauges are read from the `AsyncLLM` at
scrape time. Each server has its own `CollectorRegistry`, so several servers in one process do not
clash.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from trtssd.text.output_processor import RequestOutput
from trtssd.serving.async_llm import AsyncLLM
from trtssd.serving.metric_catalog import (ENGINE_INDEX, LABELS, METRICS, Kind, MetricDef, request_additions,
                                           series_from_start)

CONTENT_TYPE = CONTENT_TYPE_LATEST  # of exposition()


def _family(definition: MetricDef, registry: CollectorRegistry):
    labels = LABELS + ((definition.label,) if definition.label else ())
    if definition.kind is Kind.HISTOGRAM:
        return Histogram(definition.name, definition.doc, labels, buckets=definition.buckets, registry=registry)
    family = Counter if definition.kind is Kind.COUNTER else Gauge
    return family(definition.name, definition.doc, labels, registry=registry)


class ServerMetrics:
    def __init__(self, model_name: str, k: int):
        self.registry = CollectorRegistry()
        self._labels = (model_name, ENGINE_INDEX)
        self._families = {d.key: _family(d, self.registry) for d in METRICS}
        # The series without a label of their own, bound to this server's labels once.
        self._series = {d.key: self._families[d.key].labels(*self._labels) for d in METRICS if d.label is None}
        for key, value in series_from_start(k):
            self._counter(key, value)

    def track(self, async_llm: AsyncLLM) -> None:
        """Read the gauges from ``async_llm`` at each scrape."""
        self._series["num_running"].set_function(lambda: async_llm.num_running)
        self._series["num_waiting"].set_function(lambda: async_llm.num_waiting)
        self._series["draft_degraded"].set_function(lambda: float(async_llm.llm.draft_state == "lost"))

    def observe(self, record: RequestOutput) -> None:
        """Count one finished request (called on its event loop as its record is made)."""
        additions = request_additions(record)
        for (key, value), amount in additions.increments.items():
            self._counter(key, value).inc(amount)
        for key, value in additions.observations:
            self._series[key].observe(value)

    def exposition(self) -> bytes:
        """The text format served at GET /metrics."""
        return generate_latest(self.registry)

    def _counter(self, key: str, value: str | None):
        """The series of counter ``key``; ``value``: its own label's, or None when it has none."""
        return self._series[key] if value is None else self._families[key].labels(*self._labels, value)
