"""Prefix caching with speculation on and off, on the default ggml engine: the same multi-turn
chats (each turn resends the whole history and the previous answer), greedy, give every request
the same cached tokens, so the same hit rate, in `ar`, in the default mode and in `ssd` forced to
speculate, on the target and on the draft. Each turn reuses all that the cache's rule allows of
the earlier turns' prompts: a finished request leaves its prompt cached, not its answer, and
speculation (tree rows, rejected tokens, rounds the draft never saw) adds nothing and takes
nothing away. `/metrics` reads the hit rate of both ranks."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from trtssd import LLM, SamplingParams
from trtssd.backends.base import PromptSplits
from trtssd.bench.prefill_load import filler_text
from trtssd.build import build_engine
from trtssd.models.catalog import DEFAULT_ENGINE
from trtssd.models.tokenizer import chat_prompt_ids

pytestmark = pytest.mark.slow

CONVERSATIONS, TURNS, MAX_TOKENS = 2, 3, 16
MODES = {"ar": dict(mode="ar"), "default": {}, "ssd": dict(mode="ssd", plain_under_load=False)}


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("llama_cpp")
    return str(build_engine(DEFAULT_ENGINE, backend="ggml", progress=False))


def _question(conversation: int, turn: int) -> dict:
    return {"role": "user", "content": filler_text(20, 10 * conversation + turn)}


def _chats(answer) -> list[list[dict]]:
    """Each turn's messages, conversations one after another (one system prompt shared by all);
    ``answer(messages)`` gives a turn's answer text, which the next turn resends."""
    turns = []
    for c in range(CONVERSATIONS):
        messages = [{"role": "system", "content": filler_text(150, 0)}]
        for t in range(TURNS):
            messages.append(_question(c, t))
            turns.append(list(messages))
            messages.append({"role": "assistant", "content": answer(messages)})
    return turns


def _reusable(splits: PromptSplits, prompt: list[int], earlier: list[list[int]]) -> int:
    """What the cache's rule gives ``prompt`` when every earlier prompt is kept: the longest prefix
    it shares with one of them (at least a whole block, short of the whole prompt), ending where
    the rank may split a prompt."""
    shared = min(max((_common(prompt, p) for p in earlier), default=0), len(prompt) - 1)
    ends = [n for n in range(1, shared + 1) if splits.allows(n, len(prompt))]
    return max(ends, default=0) if shared >= splits.block else 0


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _expected(splits: PromptSplits, prompts: list[list[int]]) -> list[int]:
    return [_reusable(splits, p, prompts[:i]) for i, p in enumerate(prompts)]


def _draft_splits(llm: LLM) -> PromptSplits:
    return llm.loop.draft.server.worker.executor.capabilities.prompt_splits


def _run(engine: str, options: dict) -> dict:
    """The chats on a fresh engine (launched in this process): per request its prompt, output and
    the cached tokens each rank reported, with the ranks' prompt splits."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = []

    def answer(messages):
        outs.append(llm.chat(messages, params))
        return outs[-1].text

    with LLM(engine, launch="local", **options) as llm:
        _chats(answer)
        splits = (llm.loop.target.capabilities.prompt_splits, _draft_splits(llm) if llm.loop.draft is not None else None)
    return {"prompts": [o.prompt_token_ids for o in outs], "outputs": [o.token_ids for o in outs],
            "cached": [o.num_cached_tokens for o in outs], "splits": splits,
            "draft_cached": [o.speculation.draft_cached_tokens for o in outs],
            "draft_looked_up": [o.speculation.draft_prompt_tokens for o in outs]}


@pytest.fixture(scope="module")
def runs(engine) -> dict[str, dict]:
    return {mode: _run(engine, options) for mode, options in MODES.items()}


def test_the_target_caches_the_same_with_speculation_on_and_off(runs):
    ar = runs["ar"]
    expected = _expected(ar["splits"][0], ar["prompts"])
    assert sum(expected[1:TURNS]) > 0  # later turns hit the earlier turns' prompts
    for mode, run in runs.items():
        assert run["outputs"] == ar["outputs"], mode  # greedy: the same answers, so the same next prompts
        assert run["prompts"] == ar["prompts"], mode
        assert run["cached"] == expected, mode


def test_the_draft_caches_the_same_in_the_default_mode_as_when_forced_to_speculate(runs):
    forced, default = runs["ssd"], runs["default"]
    prompts = forced["prompts"]
    assert forced["draft_looked_up"] == [len(p) for p in prompts]
    assert forced["draft_cached"] == _expected(forced["splits"][1], prompts)
    # Load control may decode a request of the default mode plainly from start to end: the draft
    # then never sees its prompt, and a later turn may find less there. Compared: the requests up
    # to the first the default mode's draft did not look up (all of them when it speculated for each).
    seen = next((i for i, n in enumerate(default["draft_looked_up"]) if not n), len(prompts))
    assert default["draft_looked_up"][:seen] == forced["draft_looked_up"][:seen]
    assert default["draft_cached"][:seen] == forced["draft_cached"][:seen]


# --- over HTTP ---------------------------------------------------------------------------------

COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "trtssd:draft_prefix_cache_queries_total", "trtssd:draft_prefix_cache_hits_total")


def _counters(url: str) -> dict[str, float]:
    """The prefix-cache counters of a scrape (0 for a series not made yet)."""
    text = httpx.get(url + "/metrics").text
    found = {n: re.search(rf"^{re.escape(n)}{{[^}}]*}} (\S+)$", text, re.M) for n in COUNTERS}
    return {n: float(m.group(1)) if m else 0.0 for n, m in found.items()}


def _serve_chats(engine: str, options: dict) -> tuple[dict[str, float], list[int], list[int], tuple]:
    """The chats through `trtssd serve`'s stack: the counters' increase, each turn's prompt tokens
    and cached tokens from its usage, and each rank's expected cached tokens."""
    from trtssd.serving.openai_server import OpenAIServer
    from trtssd.serving.uvicorn_runner import BackgroundServer

    usage = []

    def answer(messages):
        out = client.chat.completions.create(model="smol", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        usage.append(out.usage)
        return out.choices[0].message.content

    with LLM(engine, launch="local", **options) as llm, BackgroundServer(OpenAIServer(llm, "smol")) as bg:
        client = openai.OpenAI(base_url=bg.url + "/v1", api_key="none")
        before = _counters(bg.url)
        turns = _chats(answer)
        after = _counters(bg.url)
        prompts = [chat_prompt_ids(llm.tokenizer, messages) for messages in turns]
        expected = (_expected(llm.loop.target.capabilities.prompt_splits, prompts),
                    _expected(_draft_splits(llm), prompts) if llm.loop.draft is not None else None)
    assert [u.prompt_tokens for u in usage] == [len(p) for p in prompts]
    increase = {n: after[n] - before[n] for n in COUNTERS}
    return increase, [u.prompt_tokens for u in usage], [u.prompt_tokens_details.cached_tokens for u in usage], expected


def test_metrics_show_the_same_hit_rate_with_speculation_on_and_off(engine):
    ar, ar_prompt, ar_cached, (ar_expected, _) = _serve_chats(engine, MODES["ar"])
    ssd, prompt, cached, (expected, draft_expected) = _serve_chats(engine, MODES["ssd"])
    assert ar_cached == cached == ar_expected == expected and ar_prompt == prompt
    assert ar == {"vllm:prefix_cache_queries_total": sum(prompt), "vllm:prefix_cache_hits_total": sum(expected),
                  "trtssd:draft_prefix_cache_queries_total": 0, "trtssd:draft_prefix_cache_hits_total": 0}
    assert ssd == {"vllm:prefix_cache_queries_total": sum(prompt), "vllm:prefix_cache_hits_total": sum(expected),
                   "trtssd:draft_prefix_cache_queries_total": sum(prompt),
                   "trtssd:draft_prefix_cache_hits_total": sum(draft_expected)}


def test_a_seeded_sampled_request_repeats_itself_once_its_prompt_is_cached_on_torch():
    """The torch draft's split prefill rounds differently from one prefill, which moves its q'
    and so which proposals a seeded request accepts: the request takes no cached prefix there,
    and its output is the same before and after its prompt is cached."""
    from trtssd.build import default_engine

    prompt = filler_text(60, 3) + " Tell me about cats."
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=32)
    with LLM(str(default_engine()), **MODES["ssd"]) as llm:
        outs = [llm.generate([prompt], params)[0] for _ in range(3)]
    assert [o.token_ids for o in outs[1:]] == [outs[0].token_ids] * 2
    assert [o.speculation.draft_cached_tokens for o in outs] == [0, 0, 0]
