"""The serving tests' raw streaming client: reads the SSE stream of one request into what a
client would keep, and reads numbers from /metrics (prometheus_client's parser).

A test that needs only the chunks is better served by the `openai` client's streaming. This one
is for tests that must see the stream as sent: the official client stops at ``data: [DONE]``
without saying whether it came (a truncated stream looks complete to it), and turns an error
event into an exception, dropping what followed it. The events are split by the benchmark's
decoder (trtssd.bench.serve.SSEDecoder), so the repository has a single one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from trtssd.bench.serve import SSEDecoder


@dataclass
class Streamed:
    chunks: list[dict] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: dict | None = None
    done: bool = False  # saw data: [DONE]; what the openai client cannot tell


def add_event(result: Streamed, data: str) -> None:
    if data == "[DONE]":
        result.done = True
        return
    event = json.loads(data)
    if "error" in event:
        result.error = event["error"]
        return
    result.chunks.append(event)
    if event.get("usage"):
        result.usage = event["usage"]
    for choice in event["choices"]:
        result.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        result.token_ids += choice.get("token_ids") or []
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


async def stream_request(client: httpx.AsyncClient, path: str, body: dict) -> Streamed:
    result, decoder = Streamed(), SSEDecoder()
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for chunk in response.aiter_bytes():
            for data in decoder.feed(chunk):
                add_event(result, data)
    return result


def scrape(client: httpx.Client, name: str, **labels) -> float:
    """The sum of the samples of metric ``name`` whose labels include ``labels``. The parser
    names every counter's samples ``..._total`` (Triton's counters have no such suffix), so a
    counter is found under either spelling."""
    spellings = {name, f"{name}_total"}
    families = text_string_to_metric_families(client.get("/metrics").text)
    return sum(sample.value for family in families for sample in family.samples
               if (sample.name == name or family.type == "counter" and sample.name in spellings)
               and all(sample.labels.get(k) == str(v) for k, v in labels.items()))
