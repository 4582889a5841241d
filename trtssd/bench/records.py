"""What one benchmark run records (per request, per batch, per run) and its summary statistics."""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from trtssd.runtime.metrics import SpeculationMetrics

log = logging.getLogger(__name__)


def read_result(path: Path) -> dict:
    """A result file, or its gzipped copy beside it (``<name>.gz``: docs/bench keeps large ones so)."""
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


@dataclass(frozen=True)
class RunKey:
    """One cell of the sweep."""

    system: str  # one of ALL_SYSTEMS
    dataset: str
    batch_size: int
    temperature: float
    k: int | None = None  # lookahead (sd, ssd, hf-assisted)
    budget: int | None = None  # fan-out budget (ssd)

    @property
    def config(self) -> str:
        """The system with its speculation settings, e.g. 'ssd K=5 B=12'."""
        parts = [self.system]
        if self.k is not None:
            parts.append(f"K={self.k}")
        if self.budget is not None:
            parts.append(f"B={self.budget}")
        return " ".join(parts)


@dataclass(frozen=True)
class RequestRecord:
    prompt_id: str
    prompt_tokens: int
    output_ids: tuple[int, ...]
    finish_reason: str
    ttft_s: float  # request start to its first output token
    e2e_s: float  # request start to its last output token
    token_latencies_s: tuple[float, ...]  # per output token after the first (see per_token_latencies)
    deliveries: int = 0  # times tokens reached the caller (a speculative round delivers several)
    first_delivery_tokens: int = 1  # tokens that arrived with the first one (what TTFT paid for)
    valid: bool | None = None  # the answer matched its entry's schema / tool parameters (None: nothing to check)
    invalid_reason: str | None = None


@dataclass(frozen=True)
class BatchRecord:
    requests: tuple[RequestRecord, ...]
    wall_s: float  # the whole batch, prefill included
    prefill_s: float  # until every request of the batch had its first token


@dataclass
class RunResult:
    key: RunKey
    summary: dict = field(default_factory=dict)
    requests: list[RequestRecord] = field(default_factory=list)
    error: str | None = None  # why the run did not happen (skipped peer, failed load, ...)
    prediction: dict | None = None  # the speedup model's view of this run

    def to_dict(self) -> dict:
        return {"key": asdict(self.key), "config": self.key.config, "summary": self.summary, "error": self.error,
                "prediction": self.prediction,
                "requests": [{k: v for k, v in asdict(r).items() if k != "token_latencies_s"} for r in self.requests]}


def per_token_latencies(emissions: Sequence[tuple[float, int]]) -> list[float]:
    """Latency of each token after the first, from (time, tokens emitted at that time) events.

    Tokens that arrive together (one speculative round) share the gap since the previous
    emission equally, so the list has one entry per token and sums to the decode time.
    """
    out: list[float] = []
    for (t0, _), (t1, n) in zip(emissions, emissions[1:]):
        if n > 0:
            out += [(t1 - t0) / n] * n
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100]; got {q!r}")
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def summarize(batches: Sequence[BatchRecord], spec: SpeculationMetrics | None) -> dict:
    """Throughput, latency percentiles and (for trtssd) the speculation metrics of one run."""
    requests = [r for b in batches for r in b.requests]
    tokens = sum(len(r.output_ids) for r in requests)
    wall = sum(b.wall_s for b in batches)
    decode_s = sum(b.wall_s - b.prefill_s for b in batches)
    decode_tokens = sum(max(len(r.output_ids) - r.first_delivery_tokens, 0) for r in requests)
    latencies = [x for r in requests for x in r.token_latencies_s]
    deliveries = sum(r.deliveries for r in requests)
    ttfts = [r.ttft_s for r in requests]
    out = {
        "num_requests": len(requests),
        "output_tokens": tokens,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        # After each request's first delivery (prefill, plus the first round where it arrives
        # with it): the steady state the speedup model predicts.
        "decode_tokens_per_s": round(decode_tokens / decode_s, 3) if decode_s > 0 else None,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "per_token_p50_ms": _ms(percentile(latencies, 50)),
        "per_token_p99_ms": _ms(percentile(latencies, 99)),
        # Accepted + bonus per round for peers that report no metrics (transformers' assisted
        # generation delivers each round's tokens at once); 1 for plain decoding.
        "tokens_per_delivery": round(tokens / deliveries, 4) if deliveries else None,
    }
    grammar = grammar_summary(spec, tokens)
    if grammar is not None:
        out["grammar"] = grammar
    if spec is not None and spec.num_drafts:  # ar runs carry metrics too, with no rounds in them
        s = spec.summary()
        out.update({name: s[name] for name in ("mean_acceptance_length", "acceptance_rate_per_position",
                                                "cache_hit_rate", "overlap_efficiency")})
        out["spec"] = s
    return out


GRAMMAR_FIELDS = ("grammar_rounds", "grammar_proposed_tokens", "grammar_accepted_tokens", "grammar_mask_time_s")


def grammar_summary(spec: SpeculationMetrics | None, output_tokens: int) -> dict | None:
    """The structured-output fields of a run's SpeculationMetrics (grammar-forced proposals, their
    acceptance, mask time), with the forced share of the output; None for an unconstrained run."""
    if spec is None or not (spec.grammar_rounds or spec.grammar_mask_time_s):
        return None
    out: dict = {name: getattr(spec, name) for name in GRAMMAR_FIELDS}
    out["grammar_mask_time_s"] = round(spec.grammar_mask_time_s, 6)
    proposed, accepted = spec.grammar_proposed_tokens, spec.grammar_accepted_tokens
    out["forced_acceptance_rate"] = round(accepted / proposed, 4) if proposed else None
    out["forced_share"] = round(accepted / output_tokens, 4) if output_tokens else None
    out["mask_ms_per_token"] = round(spec.grammar_mask_time_s * 1e3 / output_tokens, 4) if output_tokens else None
    return out
