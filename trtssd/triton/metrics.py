"""The serving metrics on Triton's metrics port, through the Python backend's ``pb_utils.MetricFamily``:
the families of trtssd/serving/metric_catalog.py, which `trtssd serve`'s ``/metrics`` exposes too
(tests/test_triton.py checks that the names come out the same), next to Triton's own
``nv_inference_*``. Every request is counted once, from its final record.
"""

from __future__ import annotations

from trtssd.text.output_processor import RequestOutput
from trtssd.serving.metric_catalog import ENGINE_INDEX, LABELS, METRICS, request_additions, series_from_start


def exposed_names() -> set[str]:
    """Every metric family this module exposes."""
    return {d.exposed_name for d in METRICS}


class TritonMetrics:
    """The metric families of one model instance. Every call is a message to the Triton server:
    call `observe` and `set_gauges` off the engine's thread."""

    def __init__(self, pb_utils, model_name: str, k: int):
        self._labels = dict(zip(LABELS, (model_name, ENGINE_INDEX)))
        # The families are kept: Triton refuses updates to a metric whose family was deleted.
        # Triton exposes a family under the name it is given, hence `exposed_name` (a counter's ``_total``).
        family = pb_utils.MetricFamily
        self._families = {d.key: family(name=d.exposed_name, description=d.doc, kind=getattr(family, d.kind.value))
                          for d in METRICS}
        self._label_names = {d.key: d.label for d in METRICS if d.label}
        self._series = {d.key: self._metric(d.key, self._labels, d.buckets) for d in METRICS if d.label is None}
        self._labelled: dict[tuple[str, str], object] = {}
        self._gauge_values: dict[str, float] = {}
        for key, value in series_from_start(k):
            self._counter(key, value)

    def observe(self, record: RequestOutput) -> None:
        """Count one finished request."""
        additions = request_additions(record)
        for (key, value), amount in additions.increments.items():
            self._counter(key, value).increment(amount)
        for key, value in additions.observations:
            self._series[key].observe(value)

    def set_gauges(self, num_running: int, num_waiting: int, draft_degraded: bool) -> None:
        """Set the gauges (only those that changed: each set is a message to the server)."""
        for key, value in (("num_running", num_running), ("num_waiting", num_waiting),
                           ("draft_degraded", float(draft_degraded))):
            if self._gauge_values.get(key) != value:
                self._series[key].set(value)
                self._gauge_values[key] = value

    def close(self) -> None:
        """Drop the metrics, then their families (Triton wants that order)."""
        self._series.clear()
        self._labelled.clear()
        self._families.clear()

    def _metric(self, key: str, labels: dict[str, str], buckets: tuple[float, ...] = ()):
        family = self._families[key]
        return family.Metric(labels=labels, buckets=list(buckets)) if buckets else family.Metric(labels=labels)

    def _counter(self, key: str, value: str | None):
        """The series of counter ``key``; ``value``: its own label's, or None when it has none."""
        if value is None:
            return self._series[key]
        metric = self._labelled.get((key, value))
        if metric is None:
            labels = {**self._labels, self._label_names[key]: value}
            metric = self._labelled[(key, value)] = self._metric(key, labels)
        return metric
