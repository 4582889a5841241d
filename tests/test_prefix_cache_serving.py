"""Prefix caching over a real socket: `trtssd serve`'s stack on the default engine, its draft a real
MPI rank, asked through the `openai` client. A repeated 1,000-token prefix hits the cache on both
ranks (vLLM's metrics, and `usage.prompt_tokens_details.cached_tokens`), greedy output with the
cache equals output without it, and a cache far smaller than the traffic evicts without losing a
request."""

from __future__ import annotations

import concurrent.futures
import random
import re

import httpx
import openai
import pytest

from trtssd import LLM
from trtssd.serving.openai_server import OpenAIServer
from trtssd.serving.uvicorn_runner import BackgroundServer

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

MODEL = "smol"


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


PREFIX = _ids(1000, 0)


@pytest.fixture(scope="module")
def server():
    # One kept prompt: the eviction test's traffic holds three prefixes.
    # Speculating always: the draft then prefills (and caches) every prompt.
    with LLM(mode="ssd", max_batch=4, max_model_len=1200, fanout=(2, 1, 1, 1, 1, 1), prefix_cache_seqs=1,
             plain_under_load=False) as llm:
        with BackgroundServer(OpenAIServer(llm, MODEL)) as bg:
            bg.splits = llm.loop.target.capabilities.prompt_splits
            yield bg


def _reusable(splits, shared: int, length: int) -> int:
    """The longest cached prefix a prompt of ``length`` tokens sharing ``shared`` with a cached one
    gets: at least a whole block, short of the whole prompt, ending where the target may split a
    prompt."""
    shared = min(shared, length - 1)
    ends = [n for n in range(1, shared + 1) if splits.allows(n, length)]
    return max(ends, default=0) if shared >= splits.block else 0


def _complete(client: openai.OpenAI, prompt: list[int]) -> tuple[str, int]:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "trtssd:draft_prefix_cache_hits_total")
    return {n: float(re.search(rf"^{re.escape(n)}{{[^}}]*}} (\S+)$", text, re.M).group(1)) for n in names}


def test_a_repeated_long_prefix_hits_the_cache_on_both_ranks(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    first, cached = _complete(client, PREFIX + _ids(20, 1))
    assert cached == 0
    before = _counters(server.url)
    again, cached = _complete(client, PREFIX + _ids(20, 1))
    other, other_cached = _complete(client, PREFIX + _ids(30, 2))
    after = _counters(server.url)
    assert again == first  # greedy output with the cache equals output without
    # The shared prefix, short of the whole prompt (on torch 1,019 and 1,000 tokens; on a ggml
    # target 64-token tiles leaving a long enough rest, 896 and 960).
    expected = (_reusable(server.splits, 1020, 1020), _reusable(server.splits, 1000, 1030))
    assert (cached, other_cached) == expected and min(expected) >= 896
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == 1020 + 1030
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == sum(expected)
    # The draft (never row-invariant) reuses the whole shared prefix.
    assert after["trtssd:draft_prefix_cache_hits_total"] - before["trtssd:draft_prefix_cache_hits_total"] == 1019 + 1000


def test_a_small_cache_evicts_without_losing_a_request(server):
    """Three prefixes, six requests at once, one kept prompt: every request completes with the
    output it has alone and uncached."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    prompts = [_ids(300, seed) + _ids(10, 100 + seed) for seed in (10, 11, 12) * 2]
    alone = [_complete(client, p)[0] for p in prompts[:3]]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda p: _complete(client, p), prompts))
    assert [text for text, _ in together] == alone * 2
    assert httpx.get(server.url + "/health").status_code == 200
