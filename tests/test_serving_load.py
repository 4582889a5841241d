"""The server under load with a real draft rank (spawn launch, tiny models): greedy output of
concurrent clients equals offline ar decoding; 64 concurrent streams of mixed lengths and
sampling all complete whole; then the draft is killed mid-load and every request still completes
correctly while /health stays 200 and the metrics show the degradation."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx
import pytest

from sse_client import Streamed, scrape, stream_request
from trtssd import LLM, ModelRef, SamplingParams
from trtssd.serving.openai_server import OpenAIServer
from trtssd.serving.uvicorn_runner import BackgroundServer

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

MAX_SEQ_LEN = 128
STOP_TOKEN = 7


@pytest.fixture(scope="module")
def served(tiny_pair):
    """One ssd server whose draft is its own MPI job; speculation every round (no load control),
    so the draft is in use when it is killed."""
    with LLM(target=ModelRef(str(tiny_pair[0])), draft=ModelRef(str(tiny_pair[1])), mode="ssd", launch="spawn", max_batch=16,
             max_model_len=MAX_SEQ_LEN, draft_timeout_s=10.0, plain_under_load=False) as llm:
        with BackgroundServer(OpenAIServer(llm, "tiny")) as bg:
            yield llm, bg


def _bodies(n: int, seed: int) -> list[dict]:
    """Mixed prompts, lengths and sampling: half greedy (some with a stop token), the rest sampled
    with top-p, top-k or min-p, seeded or not."""
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        body = {"prompt": [rng.randrange(64) for _ in range(rng.randint(1, 20))],
                "max_tokens": rng.choice([1, 4, 16, 33, 64]), "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        kind = i % 4
        if kind == 0:
            body |= {"temperature": 0}
        elif kind == 1:
            body |= {"temperature": 0, "stop_token_ids": [STOP_TOKEN]}
        elif kind == 2:
            body |= {"temperature": 0.8, "top_p": 0.9, "seed": i}
        else:
            body |= {"temperature": 1.0, "top_k": 10, "min_p": 0.05}
        bodies.append(body)
    return bodies


def _greedy_reference(tiny_pair, bodies: list[dict]) -> dict[int, list[int]]:
    """Offline LLM.generate in ar mode for the greedy requests, by index."""
    greedy = {i: b for i, b in enumerate(bodies) if b.get("temperature") == 0}
    params = [SamplingParams(temperature=0, max_tokens=b["max_tokens"],
                             stop_token_ids=tuple(b.get("stop_token_ids", ()))) for b in greedy.values()]
    with LLM(target=ModelRef(str(tiny_pair[0])), mode="ar", launch="local", max_model_len=MAX_SEQ_LEN, max_batch=16) as llm:
        outs = llm.generate([b["prompt"] for b in greedy.values()], params)
    return {i: o.token_ids for i, o in zip(greedy, outs)}


def _check_whole(body: dict, got: Streamed) -> None:
    """Nothing lost or truncated: [DONE] after a finish reason, and the usage counts the tokens."""
    assert got.done and got.error is None
    assert got.usage == {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(got.token_ids),
                         "total_tokens": len(body["prompt"]) + len(got.token_ids),
                         "prompt_tokens_details": {"cached_tokens": 0}}
    if got.finish_reason == "length":
        assert len(got.token_ids) == body["max_tokens"]
    else:
        assert got.finish_reason == "stop" and got.token_ids[-1] in body.get("stop_token_ids", ())
        assert len(got.token_ids) <= body["max_tokens"]


async def _run(url: str, bodies: list[dict], after=None, when_done: int = 0) -> list[Streamed]:
    """All bodies at once, streaming; ``after()`` runs once ``when_done`` of them have finished."""
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(stream_request(client, "/v1/completions", b)) for b in bodies]
        if after is not None:
            pending = set(tasks)
            while len(tasks) - len(pending) < when_done:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            after()
        return await asyncio.gather(*tasks)


def test_greedy_output_of_8_concurrent_clients_equals_offline_ar(tiny_pair, served):
    llm, bg = served
    bodies = [{"prompt": [i + 1] * (i + 1), "max_tokens": 10 + 5 * i, "temperature": 0, "return_token_ids": True}
              for i in range(8)]
    reference = _greedy_reference(tiny_pair, bodies)

    async def one(client, i, body):
        if i % 2:  # half stream, half not
            return (await stream_request(client, "/v1/completions", body)).token_ids
        return (await client.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]

    async def main():
        async with httpx.AsyncClient(base_url=bg.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i, b) for i, b in enumerate(bodies)))

    drafts = scrape(httpx.Client(base_url=bg.url), "vllm:spec_decode_num_drafts_total")
    got = asyncio.run(main())
    assert got == [reference[i] for i in range(8)]
    assert scrape(httpx.Client(base_url=bg.url), "vllm:spec_decode_num_drafts_total") > drafts  # it speculated


def test_64_concurrent_streams_then_a_killed_draft(tiny_pair, served):
    llm, bg = served
    client = httpx.Client(base_url=bg.url)
    first, second = _bodies(64, seed=1), _bodies(64, seed=2)
    reference = _greedy_reference(tiny_pair, first + second)

    got = asyncio.run(_run(bg.url, first))
    for i, (body, out) in enumerate(zip(first, got)):
        _check_whole(body, out)
        if i in reference:
            assert out.token_ids == reference[i], i
    assert llm.draft_state == "alive" and scrape(client, "trtssd:draft_degraded") == 0
    assert scrape(client, "vllm:spec_decode_num_drafts_total") > 0

    pid = llm.loop.draft.pid
    assert pid is not None and pid != os.getpid()
    got = asyncio.run(_run(bg.url, second, after=lambda: os.kill(pid, signal.SIGKILL), when_done=8))
    for i, (body, out) in enumerate(zip(second, got)):
        _check_whole(body, out)
        if i + len(first) in reference:
            assert out.token_ids == reference[i + len(first)], i
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["draft"] == "lost"
    assert llm.draft_state != "alive"
    assert scrape(client, "trtssd:draft_degraded") == 1
    assert scrape(client, "trtssd:degraded_rounds_total") > 0
    assert scrape(client, "vllm:request_success_total") == 8 + 64 + 64
    assert scrape(client, "vllm:num_requests_running") == scrape(client, "vllm:num_requests_waiting") == 0
