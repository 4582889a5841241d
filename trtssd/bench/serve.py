"""`trtssd bench serve`: load-test a running OpenAI-compatible server (or Triton's generate_stream) over HTTP, as `vllm bench serve` does.

    trtssd serve --mode ssd --port 8000 &                      # any OpenAI-compatible server will do
    trtssd bench serve --base-url http://127.0.0.1:8000 --concurrency 1,2,4,8,16 --num-prompts 64 \\
        --max-tokens 128 --ignore-eos --label ssd --out serve-ssd
    trtssd bench serve --request-rate 2 --num-prompts 100 --out serve-rate      # Poisson arrivals
    trtssd bench serve --compare serve-ar serve-ssd --out serve-cmp             # side by side
    trtssd bench serve --backend triton --base-url http://127.0.0.1:8000 \
        --metrics-url http://127.0.0.1:8002/metrics --out serve-triton        # Triton's generate_stream

Each request streams (``stream: true`` with ``stream_options.include_usage``) and is timed on the
client: TTFT = send to the first token chunk, ITL = the gaps between token chunks (a token chunk
carries new tokens, whether or not their text is empty, as `vllm bench serve` counts them: a
special token decodes to no text; a chat stream's role-only opening and a closing chunk with only
the finish reason are not token chunks),
E2E = send to ``data: [DONE]``, TPOT = (E2E - TTFT) / (output tokens - 1). Output tokens come from
the final usage chunk, not from the number of chunks: a speculative server sends several tokens per
chunk, so counting chunks would undercount its throughput by about the acceptance length.
Speculative acceptance and the SSD cache hit rate are the difference of the server's ``/metrics``
counters before and after each run. HTTP errors, disconnects and truncated streams count as failed
requests; only an unreachable server (the warm-up request fails) stops the benchmark.

With ``--backend triton`` the requests go to Triton's ``/v2/models/<model>/generate_stream`` (the
body `vllm bench serve --backend tensorrt-llm` sends, with ``exclude_input_in_output``); the stream
ends when the server closes it, and output tokens come from each event's ``num_output_tokens``
(the trtssd model's running count). Triton serves metrics on its own port: ``--metrics-url``.

A prompt-set entry may carry structured-output fields (``response_format``, ``structured_outputs``,
``tools``, ``tool_choice``, or ``schema`` for a json_schema response format; the built-in set
``json-schemas`` has eight schemas and two forced tool calls): they go with that request as they
are (without ``ignore_eos``, which a constraint cannot take), and each answer is checked with
``jsonschema`` against its schema, or a call's arguments against its function's parameters. The
report counts the valid answers, and the grammar-forced tokens from the server's
``trtssd:structured_output_*`` counters where it has them.

Writes results.json, results.md and serve.png (throughput and latency vs load) to ``--out``;
``--compare`` writes compare.json, compare.md and compare.png. Tables and plots: serve_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import re
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

import trtssd.bench.serve_report as serve_report
from trtssd.bench.prompts import BUILTIN_SETS, KNOWN_SETS, PromptItem, load_prompt_set
from trtssd.bench.report import machine_info
from trtssd.bench.workload import Structured, Verdict, judge, validity_counts

if TYPE_CHECKING:
    from prometheus_client.samples import Sample

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16)
BACKENDS = ("openai", "triton")
TRITON_MODEL = "trtssd"  # the model name `trtssd triton-repo` writes


class ServeBenchError(RuntimeError):
    """The benchmark cannot run at all (server unreachable, no model): not a per-request failure."""


# --- what to run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """One point of the sweep: at most `concurrency` requests in flight, arriving at `request_rate`."""

    concurrency: int | None  # None: no cap
    request_rate: float = math.inf  # requests/s; inf: all queued at t=0 (then the cap alone sets the load)

    @property
    def name(self) -> str:
        parts = [] if math.isinf(self.request_rate) else [f"rate={self.request_rate:g}/s"]
        parts += [] if self.concurrency is None else [f"c={self.concurrency}"]
        return " ".join(parts) or "all at once"


@dataclass(frozen=True)
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"  # or /v1/chat/completions; ignored by the triton backend
    model: str | None = None  # None: the first id of GET /v1/models (triton: "trtssd")
    backend: str = "openai"  # or "triton": Triton's generate_stream
    metrics_url: str | None = None  # None: base_url + /metrics
    api_key: str | None = None
    datasets: tuple[str, ...] = BUILTIN_SETS
    num_prompts: int = 64
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    loads: tuple[Load, ...] = tuple(Load(c) for c in DEFAULT_CONCURRENCIES)
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 = Poisson
    percentiles: tuple[float, ...] = (99.0,)  # besides mean and median (p50), as vLLM's --metric-percentiles
    timeout_s: float = 300.0  # seconds without a byte from the server before a request counts as failed
    warmup: bool = True
    label: str | None = None  # None: the model's name
    extra_body: dict = field(default_factory=dict)
    out_dir: Path = Path("bench-serve-out")
    plots: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")

    @property
    def api(self) -> str:
        """The stream's shape: "triton", "chat" or "completions"."""
        if self.backend == "triton":
            return "triton"
        return "chat" if self.endpoint.rstrip("/").endswith("chat/completions") else "completions"

    @property
    def chat(self) -> bool:
        return self.api == "chat"

    def url(self, model: str) -> str:
        if self.backend == "triton":
            return f"{self.base_url.rstrip('/')}/v2/models/{model}/generate_stream"
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    @property
    def scrape_url(self) -> str:
        return self.metrics_url or self.base_url.rstrip("/") + "/metrics"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["out_dir"] = str(self.out_dir)
        out["api_key"] = "***" if self.api_key else None  # results files get shared; the key must not be
        out["loads"] = [_load_dict(x) for x in self.loads]
        return out


def _load_dict(load: Load) -> dict:
    # JSON has no infinity: null means "all at once", as vLLM's default --request-rate inf.
    rate = None if math.isinf(load.request_rate) else load.request_rate
    return {"concurrency": load.concurrency, "request_rate": rate, "name": load.name}


@dataclass(frozen=True)
class Request:
    prompt_id: str
    body: dict
    structured: Structured | None = None  # what its answer is checked against


def build_requests(cfg: ServeConfig, model: str) -> list[Request]:
    """`num_prompts` requests taken from the datasets in turn (so HumanEval's 164 prompts do not drown
    the 24-prompt sets), each set in a seeded random order, cycling when a set runs out."""
    rng = random.Random(cfg.seed)
    sets: list[list[PromptItem]] = []
    for spec in cfg.datasets:
        items = load_prompt_set(spec)
        rng.shuffle(items)
        sets.append(items)
    picked = []
    for i in range(cfg.num_prompts):
        items = sets[i % len(sets)]
        picked.append(items[(i // len(sets)) % len(items)])
    return [Request(f"{item.dataset}/{item.id}", request_body(item, cfg, model), item.structured) for item in picked]


def request_body(item: PromptItem, cfg: ServeConfig, model: str) -> dict:
    if cfg.backend == "triton":
        return triton_body(item, cfg)
    body: dict = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if cfg.ignore_eos and item.structured is None:
        body["ignore_eos"] = True  # not OpenAI's; vLLM's and trtssd's extension (a constraint cannot take it)
    if item.structured is not None:
        body.update(structured_fields(item, cfg))
    if cfg.chat:
        if item.text is None:
            raise ValueError(f"prompt {item.id!r} is token ids; the chat endpoint needs text")
        body["messages"] = [{"role": "user", "content": item.text}]
    else:
        # Text goes raw (the server applies no chat template on /v1/completions); ids as OpenAI's int list.
        body["prompt"] = item.text if item.text is not None else list(item.token_ids or ())
    body.update(cfg.extra_body)
    return body


def structured_fields(item: PromptItem, cfg: ServeConfig) -> dict:
    """The entry's structured-output fields; tools need the chat endpoint."""
    fields = item.structured.body
    if "tools" in fields and not cfg.chat:
        raise ValueError(f"prompt {item.id!r} carries 'tools', which need --endpoint /v1/chat/completions "
                         f"(got {cfg.endpoint})")
    return fields


def triton_body(item: PromptItem, cfg: ServeConfig) -> dict:
    """The generate_stream body of `vllm bench serve --backend tensorrt-llm`, returning new text only."""
    if item.text is None:
        raise ValueError(f"prompt {item.id!r} is token ids; Triton's text_input needs text")
    if item.structured is not None:
        raise ValueError(f"prompt {item.id!r} carries structured-output fields, which --backend triton does not "
                         "send (its guided_decoding_* inputs differ); use --backend openai")
    body = {"text_input": item.text, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
            "exclude_input_in_output": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the run's start: all 0 for an infinite rate, else gamma-distributed
    gaps with mean 1/rate (burstiness 1 is a Poisson process), the first request at 0."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return [0.0] + np.cumsum(gaps[:-1]).tolist()


# --- one request -------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from sending it."""

    prompt_id: str
    sent_s: float = 0.0  # from the run's start
    content_times_s: list[float] = field(default_factory=list)  # arrival of each token chunk
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    tokens_from_usage: bool = False
    error: str | None = None
    text_parts: list[str] = field(default_factory=list)  # the answer's text as it streamed
    tool_calls: dict[int, dict] = field(default_factory=dict)  # by index: {"name", "arguments"} (chat)
    verdict: Verdict | None = None  # whether the answer matched its entry's schema (structured entries)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.content_times_s) and self.e2e_s is not None

    @property
    def ttft_s(self) -> float | None:
        return self.content_times_s[0] if self.content_times_s else None

    @property
    def itl_s(self) -> list[float]:
        t = self.content_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (tokens - 1): the mean time per token after the first, as vLLM defines it."""
        if not self.ok or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return {"prompt_id": self.prompt_id, "ok": self.ok, "error": self.error, "sent_s": _r(self.sent_s),
                "ttft_s": _r(self.ttft_s), "e2e_s": _r(self.e2e_s), "tpot_s": _r(self.tpot_s),
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "tokens_from_usage": self.tokens_from_usage, "itl_s": [_r(x) for x in self.itl_s],
                **self._verdict_dict()}

    def _verdict_dict(self) -> dict:
        if self.verdict is None or self.verdict.valid is None:
            return {}
        return {"valid": self.verdict.valid, "invalid_reason": self.verdict.reason or None}

    def judge(self, structured: Structured | None) -> None:
        """Check the answer against its entry (not a failed request's: it has no answer)."""
        if structured is not None and self.ok:
            calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            self.verdict = judge(structured, "".join(self.text_parts), calls)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class SSEDecoder:
    """Splits a byte stream into Server-Sent Events' data payloads; an event ends at a blank line
    (the serving tests' raw client, tests/sse_client.py, uses it too).

    Not the `openai` client's streaming: it cannot read Triton's generate_stream, it ends quietly
    on a stream cut short before ``data: [DONE]`` (here a failed request), and a chunk reaches its
    caller only once its model object is built: every arrival would be timed a little late."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        while (nl := self._buffer.find(b"\n")) >= 0:
            # Splitting bytes at \n is safe for UTF-8: no multi-byte character contains that byte.
            line = self._buffer[:nl].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[nl + 1:]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
            # event:, id:, retry: and ":" comments (keep-alives) carry nothing we measure
        return events


async def send_request(session, url: str, req: Request, headers: dict, api: str) -> RequestResult:
    """POST one streaming request and time it; every failure ends up in `error`, never raised."""
    import aiohttp

    result = RequestResult(req.prompt_id)
    start = time.perf_counter()
    try:
        async with session.post(url, json=req.body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
                return result
            await _read_stream(resp, result, start, api)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:  # ValueError: bad JSON or UTF-8
        result.error = f"{type(err).__name__}: {err}"[:300]
    return result


async def _read_stream(resp, result: RequestResult, start: float, api: str) -> None:
    decoder = SSEDecoder()
    now = 0.0
    async for chunk in resp.content.iter_any():
        now = time.perf_counter() - start  # every event in this read arrived now
        for data in decoder.feed(chunk):
            if data == "[DONE]":
                result.e2e_s = now
                _settle_token_count(result)
                return
            event = json.loads(data)
            if "error" in event:  # an error after the 200 arrives as an event (vLLM and Triton do this)
                result.error = f"stream error: {_error_message(json.dumps(event))}"
                return
            if api == "triton":
                _apply_triton_event(event, result, now)
            else:
                _apply_event(event, result, now, api == "chat")
    if api == "triton":  # Triton ends a decoupled stream by closing it, after the final response
        result.e2e_s = now
        _settle_token_count(result)
        return
    result.error = "stream ended before data: [DONE]"


def _apply_event(event: dict, result: RequestResult, now: float, chat: bool) -> None:
    usage = event.get("usage")
    if usage:  # the final chunk with choices == [] (or every chunk with continuous_usage_stats)
        result.prompt_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens")
        result.tokens_from_usage = result.output_tokens is not None
    choices = event.get("choices") or []
    if choices:
        choice = choices[0]
        delta = (choice.get("delta") or {}) if chat else choice
        text = (delta.get("content") or delta.get("reasoning_content")) if chat else delta.get("text")
        opening = chat and "role" in delta
        closing = choice.get("finish_reason") is not None
        calls = (delta.get("tool_calls") or []) if chat else []
        if text or calls or not (opening or closing):
            result.content_times_s.append(now)
        answer = delta.get("content") if chat else text  # reasoning is not part of the answer
        if answer:
            result.text_parts.append(answer)
        _add_tool_call_deltas(result, calls)


def _add_tool_call_deltas(result: RequestResult, calls: list[dict]) -> None:
    """OpenAI streams a call as pieces by index (name first, arguments in parts); join them."""
    for position, piece in enumerate(calls):
        fn = piece.get("function") or {}
        call = result.tool_calls.setdefault(int(piece.get("index", position)), {"name": "", "arguments": ""})
        call["name"] += fn.get("name") or ""
        call["arguments"] += fn.get("arguments") or ""


def _apply_triton_event(event: dict, result: RequestResult, now: float) -> None:
    before = result.output_tokens or 0
    if event.get("num_output_tokens") is not None:  # the running count of generated tokens
        result.output_tokens = int(_scalar(event["num_output_tokens"]))
        result.tokens_from_usage = True
    if event.get("text_output") or (result.output_tokens or 0) > before:  # new tokens, text or not
        result.content_times_s.append(now)
    if event.get("num_input_tokens") is not None:
        result.prompt_tokens = int(_scalar(event["num_input_tokens"]))


def _scalar(value):
    """Triton's generate extension writes a one-element output as a value or as a one-element list."""
    return value[0] if isinstance(value, list) else value


def _settle_token_count(result: RequestResult) -> None:
    if result.output_tokens is None:  # a server without include_usage: chunks are the best we have
        result.output_tokens = len(result.content_times_s)


def _error_message(body: str) -> str:
    try:
        err = json.loads(body)
        err = err.get("error", err) if isinstance(err, dict) else err
        message = err.get("message", body) if isinstance(err, dict) else body
    except ValueError:
        message = body
    return str(message).strip()[:200]


# --- server metrics ------------------------------------------------------------------------------

def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a /metrics page in Prometheus' text exposition format (prometheus_client's
    parser, imported here: only `trtssd bench serve` needs it; a page it cannot read raises
    ValueError)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def counter_value(samples: Sequence[Sample], name: str, **labels: str) -> float | None:
    """A counter summed over its label sets (vLLM labels by model_name and engine); prometheus_client
    writes a counter `x` as `x_total`, so both spellings are read. None when the server has no such metric."""
    for spelled in (name + "_total", name):
        hits = [s.value for s in samples if s.name == spelled and all(s.labels.get(k) == v for k, v in labels.items())]
        if hits:
            return float(sum(hits))
    return None


SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
                 # structured outputs: rounds that verified grammar-forced tokens, those tokens, the
                 # ones accepted, and the target's seconds computing token masks
                 "forced_rounds": "trtssd:structured_output_forced_rounds",
                 "forced_tokens": "trtssd:structured_output_forced_tokens",
                 "forced_accepted_tokens": "trtssd:structured_output_forced_accepted_tokens",
                 "mask_seconds": "trtssd:structured_output_mask_seconds"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
# trtssd's speculation-cache counters: trtssd:…cache_hits / trtssd:…cache_misses (the server names
# them), never a prefix cache's (trtssd:draft_prefix_cache_hits counts prompt tokens, not rounds).
_CACHE_HITS = re.compile(r"^(trtssd:(?!\w*prefix_cache)\w*cache_hits)(_total)?$")
_CACHE_MISSES = re.compile(r"^(trtssd:(?!\w*prefix_cache)\w*cache_misses)(_total)?$")


def server_counters(samples: Sequence[Sample]) -> dict[str, float]:
    """The counters the report uses, by short name; missing metrics are left out."""
    out = {key: v for key, name in SPEC_COUNTERS.items() if (v := counter_value(samples, name)) is not None}
    positions = sorted({s.labels["position"] for s in samples if s.name in (PER_POSITION, PER_POSITION + "_total")
                        and s.labels.get("position", "").isdigit()}, key=int)
    for pos in positions:
        out[f"accepted_pos_{pos}"] = counter_value(samples, PER_POSITION, position=pos)
    for key, pattern in (("cache_hits", _CACHE_HITS), ("cache_misses", _CACHE_MISSES)):
        names = sorted({m.group(1) for s in samples if (m := pattern.match(s.name))})
        if names:
            out[key] = counter_value(samples, names[0])
            out[f"{key}_metric"] = names[0]  # a string, so the report can say which metric it read
    return out


def spec_summary(before: dict | None, after: dict | None) -> dict | None:
    """Acceptance and hit rate over one run: the difference of the counters around it."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before.get(k, 0.0) for k, v in after.items() if isinstance(v, float)}
    out: dict = dict(delta)
    drafts, accepted = delta.get("drafts"), delta.get("accepted_tokens")
    if drafts and accepted is not None:
        out["mean_acceptance_length"] = round(1.0 + accepted / drafts, 4)  # vLLM's, counting the bonus token
        pos = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in delta.items() if k.startswith("accepted_pos_"))
        if pos:
            out["acceptance_rate_per_position"] = [round(v / drafts, 4) for _, v in pos]
    if delta.get("draft_tokens") and accepted is not None:
        out["acceptance_rate"] = round(accepted / delta["draft_tokens"], 4)
    if delta.get("forced_tokens") and delta.get("forced_accepted_tokens") is not None:
        out["forced_acceptance_rate"] = round(delta["forced_accepted_tokens"] / delta["forced_tokens"], 4)
    lookups = delta.get("cache_hits", 0.0) + delta.get("cache_misses", 0.0)
    if "cache_hits" in delta and lookups:
        out["cache_hit_rate"] = round(delta["cache_hits"] / lookups, 4)
    for key in ("cache_hits_metric", "cache_misses_metric"):
        if key in after:
            out[key] = after[key]
    return out


async def scrape_metrics(session, url: str, headers: dict) -> dict | None:
    """The server's counters now, or None when it has no usable /metrics (then the report says "-")."""
    import aiohttp

    try:
        async with session.get(url, headers=headers) as resp:
            if resp.status != 200:
                return None
            return server_counters(parse_prometheus(await resp.text()))
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError, ValueError):
        return None


# --- statistics ----------------------------------------------------------------------------------


def latency_stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict:
    """vLLM's keys: mean_/median_/std_/p99_<name>_ms, and max_<name>_ms (None without values).
    The max is ours: a stall that every stream waits out once (a long prefill) can sit above p99
    of the pooled gaps and still be the wait a user notices."""
    ms = np.asarray(seconds, dtype=float) * 1e3
    out = {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None}
    out.update({f"p{_q(q)}_{name}_ms": None for q in percentiles})
    out[f"max_{name}_ms"] = None
    if len(ms):
        out.update({f"mean_{name}_ms": round(float(ms.mean()), 3), f"median_{name}_ms": round(float(np.median(ms)), 3),
                    f"std_{name}_ms": round(float(ms.std()), 3)})
        out.update({f"p{_q(q)}_{name}_ms": round(float(np.percentile(ms, q)), 3) for q in percentiles})
        out[f"max_{name}_ms"] = round(float(ms.max()), 3)
    return out


def _q(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def summarize_run(results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float]) -> dict:
    """What `vllm bench serve` reports for one run."""
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens or 0 for r in ok)
    out = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration_s, 4),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": round(len(ok) / duration_s, 4) if duration_s else None,
        "output_throughput": round(total_out / duration_s, 3) if duration_s else None,
        "total_token_throughput": round((total_in + total_out) / duration_s, 3) if duration_s else None,
        # False when the server sent no usage chunk: then output tokens are chunks and undercount spec decoding.
        "tokens_from_usage": all(r.tokens_from_usage for r in ok) if ok else None,
    }
    out.update(latency_stats("ttft", [r.ttft_s for r in ok], percentiles))
    out.update(latency_stats("tpot", [r.tpot_s for r in ok if r.tpot_s is not None], percentiles))
    out.update(latency_stats("itl", [gap for r in ok for gap in r.itl_s], percentiles))
    out.update(latency_stats("e2el", [r.e2e_s for r in ok], percentiles))
    errors = Counter(r.error or "no content before [DONE]" for r in results if not r.ok)
    out["errors"] = dict(errors.most_common(10))
    validity = validity_counts([r.verdict for r in ok])
    if validity is not None:
        out["structured"] = validity
    return out


# --- runs ----------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    load: Load
    summary: dict
    spec: dict | None
    loadavg_start: tuple[float, ...]
    loadavg_end: tuple[float, ...]
    requests: list[RequestResult]

    def to_dict(self) -> dict:
        return {**_load_dict(self.load), "summary": self.summary, "spec": self.spec,
                "loadavg_start": list(self.loadavg_start), "loadavg_end": list(self.loadavg_end),
                "requests": [r.to_dict() for r in self.requests]}


@dataclass
class ServeReport:
    label: str
    command: str
    model: str
    config: ServeConfig
    machine: dict
    loadavg_start: tuple[float, ...]
    loadavg_end: tuple[float, ...] = ()
    runs: list[LoadResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"label": self.label, "command": self.command, "model": self.model, "base_url": self.config.base_url,
                "endpoint": self.config.endpoint, "config": self.config.to_dict(), "machine": self.machine,
                "loadavg_start": list(self.loadavg_start), "loadavg_end": list(self.loadavg_end),
                "runs": [r.to_dict() for r in self.runs]}


def loadavg() -> tuple[float, ...]:
    """1, 5 and 15-minute load averages: other processes share the cores, so this says how noisy the numbers are."""
    return tuple(round(x, 2) for x in os.getloadavg()) if hasattr(os, "getloadavg") else ()


def run_serve_benchmark(cfg: ServeConfig, command: str = "") -> ServeReport:
    """Every load of `cfg` against the server, one after another; raises ServeBenchError if it is unreachable."""
    return asyncio.run(_run_all(cfg, command))


async def _run_all(cfg: ServeConfig, command: str) -> ServeReport:
    import aiohttp

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # sock_read, not total: a long generation is fine, a server silent for timeout_s is not.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=cfg.timeout_s)
    # limit=0: the sweep's semaphore, not the connection pool, caps the requests in flight.
    # force_close: a connection per request. Reused ones fail on servers that close idle
    # keep-alive connections first (llama-server, after a few seconds: aiohttp then fails with "Can not write request body").
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = cfg.model or (TRITON_MODEL if cfg.backend == "triton" else
                              await _first_model(session, cfg.base_url, headers))
        requests = build_requests(cfg, model)
        report = ServeReport(cfg.label or model, command, model, cfg, machine_info(), loadavg())
        if cfg.warmup:  # not with a tool call: a model whose template has no tools refuses those alone
            plain = next((r for r in requests if r.structured is None or not r.structured.tools), requests[0])
            await _warm_up(session, cfg, model, plain, headers)
        for load in cfg.loads:
            report.runs.append(await _run_load(session, cfg, model, load, requests, headers))
        report.loadavg_end = loadavg()
    return report


async def _first_model(session, base_url: str, headers: dict) -> str:
    import aiohttp

    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=headers) as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        raise ServeBenchError(f"cannot reach {url} ({type(err).__name__}: {err}); is the server running?") from None
    models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
    if not models:
        raise ServeBenchError(f"{url} lists no model; give --model")
    return models[0]


async def _warm_up(session, cfg: ServeConfig, model: str, req: Request, headers: dict) -> None:
    """One request before measuring, as vLLM does: fails the benchmark early if the server cannot serve."""
    url = cfg.url(model)
    result = await send_request(session, url, req, headers, cfg.api)
    if not result.ok:
        raise ServeBenchError(f"warm-up request to {url} failed: {result.error or 'no content streamed'}")


async def _run_load(session, cfg: ServeConfig, model: str, load: Load, requests: list[Request],
                    headers: dict) -> LoadResult:
    avg_start = loadavg()
    url = cfg.url(model)
    before = await scrape_metrics(session, cfg.scrape_url, headers)
    offsets = arrival_offsets(len(requests), load.request_rate, cfg.burstiness, cfg.seed)
    cap = asyncio.Semaphore(load.concurrency) if load.concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def client(req: Request, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with cap:  # a request that arrived waits here for a free slot, as with vLLM's --max-concurrency
            sent = time.perf_counter() - start
            result = await send_request(session, url, req, headers, cfg.api)
        result.sent_s = sent
        result.judge(req.structured)
        return result

    results = list(await asyncio.gather(*(client(r, o) for r, o in zip(requests, offsets))))
    duration = time.perf_counter() - start
    after = await scrape_metrics(session, cfg.scrape_url, headers)
    run = LoadResult(load, summarize_run(results, duration, cfg.percentiles), spec_summary(before, after),
                     avg_start, loadavg(), results)
    s = run.summary
    if s["tokens_from_usage"] is False:
        log.warning("%s: the server sent no usage chunk; output tokens are counted as chunks (too few for a "
                    "speculative server)", load.name)
    log.info("%s: %d completed, %d failed in %.1f s; %.1f output tok/s; TTFT p50 %s ms, TPOT p50 %s ms",
             load.name, s["completed"], s["failed"], duration, s["output_throughput"] or 0.0,
             s["median_ttft_ms"], s["median_tpot_ms"])
    return run


# --- command line --------------------------------------------------------------------------------


def _ints_or_none(text: str) -> tuple[int | None, ...]:
    """'1,2,4' -> (1, 2, 4); 'none' -> (None,) for no cap."""
    if text.strip().lower() in ("none", "inf"):
        return (None,)
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints or 'none'; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1; got {text!r}")
    return values


def _rates(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers; got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"request rates must be > 0 (inf: all at once); got {text!r}")
    return values


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers; got {text!r}") from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object; got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtssd bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (default %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai: /v1/completions or /v1/chat/completions; triton: /v2/models/<model>/generate_stream")
    p.add_argument("--metrics-url", default=None,
                   help="Prometheus metrics (default BASE_URL/metrics; Triton's are on its metrics port, e.g. "
                        "http://127.0.0.1:8002/metrics)")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (prompts as text) or /v1/chat/completions (prompts as a user message)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (default $OPENAI_API_KEY)")
    p.add_argument("--datasets", default=",".join(BUILTIN_SETS),
                   help=f"built-in sets ({','.join(KNOWN_SETS)}; default {','.join(BUILTIN_SETS)}) and/or JSONL "
                        "files (or .json lists), comma-separated; entries may carry response_format, "
                        "structured_outputs, tools, tool_choice or schema")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every request runs to --max-tokens")
    p.add_argument("--seed", type=int, default=0, help="prompt order and arrival times")
    p.add_argument("--concurrency", type=_ints_or_none, default=None,
                   help="max requests in flight, a sweep: 1,2,4,8,16 (the default without --request-rate), "
                        "or 'none' (the default with it)")
    p.add_argument("--request-rate", type=_rates, default=None,
                   help="requests/s with Poisson arrivals (a sweep: 1,2,4; default: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--percentiles", type=_floats, default=(99.0,), help="besides mean and p50 (default 99)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="silence before a request counts as failed")
    p.add_argument("--extra-body", type=_json_object, default={}, help="JSON merged into every request body")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--label", default=None, help="name of this server in tables and plots (default: the model)")
    p.add_argument("--compare", nargs="+", metavar="DIR", default=None,
                   help="instead of running: put earlier --out directories side by side in --out")
    p.add_argument("--out", default="bench-serve-out", help="output directory (default %(default)s)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be >= 1")
    if args.burstiness <= 0 or args.timeout_s <= 0:
        raise ValueError("--burstiness and --timeout-s must be > 0")
    if any(not 0 < q < 100 for q in args.percentiles):
        raise ValueError(f"--percentiles must be in (0, 100); got {args.percentiles}")
    rates = args.request_rate or (math.inf,)
    concurrencies = args.concurrency or (DEFAULT_CONCURRENCIES if args.request_rate is None else (None,))
    datasets = tuple(x.strip() for x in args.datasets.split(",") if x.strip())
    return ServeConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, backend=args.backend,
        metrics_url=args.metrics_url, api_key=args.api_key, datasets=datasets,
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, temperature=args.temperature,
        ignore_eos=args.ignore_eos, seed=args.seed, loads=tuple(Load(c, r) for r in rates for c in concurrencies),
        burstiness=args.burstiness, percentiles=tuple(args.percentiles), timeout_s=args.timeout_s,
        warmup=not args.no_warmup, label=args.label, extra_body=args.extra_body,
        out_dir=Path(args.out), plots=not args.no_plots)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.compare:
        try:
            paths = serve_report.write_comparison([Path(d) for d in args.compare], Path(args.out), not args.no_plots)
        except ValueError as err:
            parser.error(str(err))
        for path in paths:
            log.info("wrote %s", path)
        sys.stdout.write(paths[1].read_text())
        return 0
    try:
        cfg = config_from_args(args)
        for spec in cfg.datasets:  # a bad dataset or entry fails before any request
            load_prompt_set(spec)
    except ValueError as err:
        parser.error(str(err))
    try:
        report = run_serve_benchmark(cfg, shlex.join(["trtssd", "bench", "serve", *(argv or sys.argv[1:])]))
    except (ServeBenchError, ValueError) as err:
        log.error("%s", err)
        return 1
    for path in serve_report.write_report(report, cfg.out_dir, cfg.plots):
        log.info("wrote %s", path)
    sys.stdout.write(serve_report.render_markdown(report.to_dict()))
    return 0 if any(r.summary["completed"] for r in report.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
