"""The OpenAI-compatible server over a real socket on 127.0.0.1: every endpoint, streaming and
not, chat templates, stop strings, usage, bad requests, API keys, client disconnects, the
official `openai` client (the real default engine, its draft in this process); overload and a
dead engine (tiny models)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import torch

from sse_client import add_event, scrape, stream_request, Streamed
from trtssd import LLM, SamplingParams
from trtssd.backends.base import chain_chunk
from trtssd.backends.loading import load_executor
from trtssd.engines import resolve_models
from trtssd.sampling import processed_logprobs
from trtssd.serving.openai_server import OpenAIServer
from trtssd.serving.uvicorn_runner import BackgroundServer

pytestmark = [pytest.mark.slow]

API_KEY = "test-key"
MODEL = "smol"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def served():
    # A fixed fan-out skips the draft's start-up calibration (seconds on a CPU) that "auto" needs.
    with LLM(mode="ssd", launch="local", max_batch=4, max_model_len=256, fanout=(2, 1, 1, 1, 1, 1)) as llm:
        with BackgroundServer(OpenAIServer(llm, MODEL, api_key=API_KEY)) as bg:
            yield llm, bg


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served[1].url, headers=AUTH, timeout=60) as c:
        yield c


def _complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, path: str, body: dict) -> Streamed:
    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as c:
            return await stream_request(c, path, body)

    return asyncio.run(run())


# --- endpoints -----------------------------------------------------------------------------------

def test_health_models_and_metrics(client):
    assert client.get("/health").json() == {"status": "ok", "mode": "ssd", "draft": "alive"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 256
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "trtssd:spec_decode_cache_hits_total",
                 "trtssd:spec_decode_backups_total", "trtssd:draft_degraded", "trtssd:overlap_efficiency_bucket"):
        assert name in text, name


def test_completion_text_usage_and_token_ids(served, client):
    llm = served[0]
    prompt = "The capital of France is"
    before = scrape(client, "vllm:generation_tokens_total")
    out = _complete(client, prompt=prompt, max_tokens=8, return_token_ids=True)
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and out["model"] == MODEL and out["id"].startswith("cmpl-")
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 8
    assert choice["text"] == llm.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    prompt_ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    assert out["prompt_token_ids"] == prompt_ids
    n = len(prompt_ids)
    # cached_tokens: prompt tokens the prefix cache gave, where OpenAI reports them (none here).
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 8, "total_tokens": n + 8,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert scrape(client, "vllm:generation_tokens_total") - before == 8


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_gives_the_same_answer_as_non_streaming(served, client, path):
    body = {"model": MODEL, "temperature": 0, "max_tokens": 12}
    body |= {"messages": [{"role": "user", "content": "Name three colours."}]} if "chat" in path \
        else {"prompt": "def add(a, b):"}
    whole = client.post(path, json=body).json()
    streamed = _stream(served[1].url, path, {**body, "stream_options": {"include_usage": True}})
    choice = whole["choices"][0]
    text = choice["message"]["content"] if "chat" in path else choice["text"]
    assert streamed.done and streamed.error is None
    assert streamed.text == text and streamed.finish_reason == choice["finish_reason"]
    counts = lambda usage: {k: v for k, v in usage.items() if k != "prompt_tokens_details"}  # noqa: E731
    assert counts(streamed.usage) == counts(whole["usage"]) and whole["usage"]["completion_tokens"] == 12
    # The repeat finds the first one's prompt in the prefix cache (a chat template's, at least).
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in (whole["usage"], streamed.usage)]
    assert cached[1] >= cached[0] and (cached[1] > 0) == ("chat" in path)
    *deltas, last = streamed.chunks
    assert last["choices"] == [] and all(c["usage"] is None for c in deltas)
    if "chat" in path:
        assert whole["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert deltas[0]["object"] == "chat.completion.chunk"
        assert deltas[0]["choices"][0]["delta"]["role"] == "assistant"


def test_a_token_without_text_is_streamed_when_it_is_made(served, client):
    """SmolLM2's first token for this raw prompt is <|im_end|>, which decodes to no text. It is
    streamed at once as a chunk with empty text, as vLLM does (before, the first chunk waited for
    the next round's text, and a client measured that round as its time to first token)."""
    prompt = "Why is the sky blue during the day but red at sunset?"
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    first = client.post("/v1/completions", json={**body, "max_tokens": 1, "return_token_ids": True}).json()
    first = first["choices"][0]["token_ids"][0]
    assert served[0].tokenizer.decode([first], skip_special_tokens=True) == ""  # the premise
    for ids in (False, True):
        streamed = _stream(served[1].url, "/v1/completions", {**body, "return_token_ids": ids})
        tokens = [c["choices"][0] for c in streamed.chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
        # Only the first is checked for emptiness: the third token (<|im_start|>) has no text
        # either, and whether it shares a chunk depends on whether its round speculated.
        assert tokens[0]["text"] == "" and len(tokens) >= 2
        assert streamed.text == client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert tokens[0]["token_ids"] == [first] and sum(len(t["token_ids"]) for t in tokens) == 6


def test_chat_applies_the_chat_template(served, client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    out = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 6,
                                                    "temperature": 0}).json()
    ids = served[0].tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert out["usage"]["prompt_tokens"] == len(ids)
    # Text parts are the same message as a plain string.
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]}, messages[1]]
    again = client.post("/v1/chat/completions", json={"model": MODEL, "messages": parts, "max_tokens": 6,
                                                      "temperature": 0}).json()
    assert again["choices"][0]["message"] == out["choices"][0]["message"]


COUNT = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def counting(served) -> str:
    """The greedy continuation of COUNT without stops."""
    with httpx.Client(base_url=served[1].url, headers=AUTH, timeout=60) as c:
        return c.post("/v1/completions", json=COUNT).json()["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_before_the_stop(served, client, counting, stream):
    stop = " 6"
    assert stop in counting, counting  # the greedy continuation counts on
    body = {**COUNT, "stop": [stop, "never"]}
    if stream:
        got = _stream(served[1].url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        text, reason, usage = got.text, got.finish_reason, got.usage
    else:
        out = client.post("/v1/completions", json=body).json()
        text, reason, usage = out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"]
    assert text == counting[:counting.index(stop)] and reason == "stop"
    # The output ends at the token that completes the stop string: the output processor found it
    # off the target's cores and the loop cut what it had emitted past it.
    tok = served[0].tokenizer
    ids = tok.encode(counting, add_special_tokens=False)
    assert usage["completion_tokens"] == next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))


# --- bad requests --------------------------------------------------------------------------------

GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, status, param, match", [
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "'prompt' is required: a non-empty string"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "'messages' is required"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", r"'temperature' must be 0 \(greedy\) or a number"),
    ("/v1/completions", {**GOOD, "max_tokens": "2"}, 400, "max_tokens", "'max_tokens' must be an integer >= 0"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream", "'stream' must be a boolean"),
    ("/v1/completions", {**GOOD, "prompt": 12}, 400, "prompt", "non-empty string or a non-empty list"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt", "non-empty"),
    ("/v1/completions", {**GOOD, "prompt": ["a", "b"]}, 400, "prompt", "larger batches are not supported"),
    ("/v1/completions", {**GOOD, "prompt": [10**9]}, 400, "prompt", r"token ids must be in \[0, 49152\)"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", r"'top_p' must be a number in \(0, 1\]"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature", r"'temperature' must be 0 \(greedy\) or a number"),
    ("/v1/completions", {**GOOD, "temperature": 5e-324}, 400, "temperature", r"temperature must be 0 \(greedy\) or .* >= 1e-06"),
    ("/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens", "'max_tokens' must be an integer >= 0"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "'max_tokens' must be an integer >= 1"),
    ("/v1/completions", {**GOOD, "prompt_logprobs": 21}, 400, "prompt_logprobs",
     r"'prompt_logprobs' must be an integer in \[0, 20\]"),
    ("/v1/completions", {**GOOD, "min_p": 1.5}, 400, "min_p", r"'min_p' must be a number in \[0, 1\)"),
    ("/v1/completions", {**GOOD, "seed": -1}, 400, "seed", "'seed' must be an integer in"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "stop", "'stop' must be a non-empty string or a list of them"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n", r"'n' must be an integer in \[1, 128\]"),
    ("/v1/completions", {**GOOD, "n": 129}, 400, "n", r"'n' must be an integer in \[1, 128\]"),
    ("/v1/completions", {**GOOD, "n": 2.5}, 400, "n", r"'n' must be an integer"),
    ("/v1/chat/completions", {**CHAT, "n": 5}, 400, "n", r"n \(5\) exceeds max_batch 4"),  # at admission
    ("/v1/completions", {**GOOD, "best_of": 3}, 400, "best_of", "'best_of' must be 1 or null: best_of .* not supported"),
    ("/v1/chat/completions", {**CHAT, "best_of": 2}, 400, "best_of", "unknown field 'best_of'"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs", r"'logprobs' must be an integer in \[0, 20\]"),
    ("/v1/completions", {**GOOD, "logprobs": True}, 400, "logprobs", "'logprobs' must be an integer"),
    ("/v1/completions", {**GOOD, "echo": "yes"}, 400, "echo", "'echo' must be a boolean"),
    ("/v1/completions", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty",
     r"'presence_penalty' must be a number in \[-2, 2\]"),
    ("/v1/completions", {**GOOD, "colour": "red"}, 400, "colour", "unknown field 'colour'; supported fields"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed with 'stream': true"),
    ("/v1/completions", {**GOOD, "stream": True, "stream_options": {"usage": True}}, 400, "stream_options",
     "unknown field 'stream_options.usage'"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "needs 'logprobs': true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     r"integer in \[0, 20\]"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, 400, "logprobs", "'logprobs' must be a boolean"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", r"'tools\[0\]\.function': Field required"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages",
     r"'messages\[0\]\.role': Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", "only text is supported"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "name": "me"}]}, 400,
     "messages", r"unknown field 'messages\[0\]\.name'"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist"),
    # The length limit is the engine's (at submit); the error names the field the user sent.
    ("/v1/completions", {**GOOD, "prompt": "word " * 300}, 400, "prompt", "exceeds.* 256"),
    ("/v1/completions", {**GOOD, "max_tokens": 1000}, 400, "max_tokens", r"max_tokens \(1000\).* exceeds.* 256"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 1000}, 400, "max_completion_tokens", "exceeds.* 256"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": None, "messages": [{"role": "user", "content": "word " * 300}]},
     400, "messages", "exceeds.* 256"),
])
def test_bad_requests_get_a_clear_4xx_and_the_server_stays_healthy(client, path, body, status, param, match):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == status and error["type"].endswith("Error")
    assert re.search(match, error["message"]), error["message"]
    assert client.get("/health").status_code == 200


def test_a_top_p_below_float32_keeps_the_most_likely_token(client):
    """5e-324 rounds to 0 in float32: top-p must still keep one token, not sample from none
    (found by the schema fuzzer: NaN logprobs could not be written as JSON, a 500)."""
    body = {**GOOD, "prompt": "Count: 1, 2,", "max_tokens": 4, "logprobs": 0}
    tiny_p = client.post("/v1/completions", json={**body, "temperature": 1, "top_p": 5e-324, "seed": 1}).json()
    greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()
    assert tiny_p["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert all(lp == 0.0 for lp in tiny_p["choices"][0]["logprobs"]["token_logprobs"])


@pytest.mark.parametrize("raw, content_type, match", [
    (b"{not json", "application/json", "not valid JSON"), (b"[1, 2]", "application/json", "must be a JSON object"),
    (b"\xff\xfe", "application/json", "not valid JSON"), (b'{"prompt": "\xfa"}', "application/json", "not valid JSON"),
    (b"", "application/json", "must be a JSON object"),
    (b'{"prompt": "Hello"}', "text/plain", "Content-Type: application/json"),
    (b'{"prompt": "Hello", "temperature": NaN}', "application/json", "'temperature' must be 0 (greedy) or a number")])
def test_malformed_json_is_400(client, raw, content_type, match):
    r = client.post("/v1/completions", content=raw, headers={"content-type": content_type})
    assert r.status_code == 400 and match in r.json()["error"]["message"]


def test_a_body_without_a_content_type_is_read_as_json(client):
    r = client.post("/v1/completions", content=b'{"prompt": "Hello", "max_tokens": 1}')
    assert r.status_code == 200, r.text


def test_unknown_routes_and_methods_answer_in_the_openai_shape(client):
    assert client.get("/v1/nothing").json()["error"]["code"] == 404
    assert client.get("/v1/completions").json()["error"]["code"] == 405


def test_the_api_key_guards_the_v1_routes(served):
    url = served[1].url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(url + "/v1/completions", json=GOOD, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"], headers
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    assert httpx.post(url + "/v1/completions", json=GOOD, headers=AUTH).status_code == 200


def test_successful_requests_after_the_bad_ones(client):
    out = _complete(client, prompt="Hello", max_tokens=3)
    assert out["usage"]["completion_tokens"] == 3


# --- cancellation --------------------------------------------------------------------------------

def test_a_client_that_disconnects_mid_stream_frees_its_rows(served, client):
    llm = served[0]
    aborted = scrape(client, "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.Client(base_url=served[1].url, headers=AUTH, timeout=60) as gone:
        with gone.stream("POST", "/v1/completions", json=body) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break
            assert scrape(client, "vllm:num_requests_running") == 1
    deadline = time.monotonic() + 10
    while scrape(client, "vllm:request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    assert scrape(client, "vllm:num_requests_running") == scrape(client, "vllm:num_requests_waiting") == 0
    assert not llm.loop.scheduler.running and not llm.loop.scheduler.waiting
    assert not llm.loop.draft.server.worker.seqs  # the draft's rows too (nothing else ran: released at once)
    assert scrape(client, "vllm:generation_tokens_total") > 0


# --- the official client -------------------------------------------------------------------------

def test_the_openai_client_works_unchanged(served):
    client = openai.OpenAI(base_url=served[1].url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    done = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
    pieces = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == done.choices[0].text
    assert pieces[-1].usage.completion_tokens == 5
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, seed=1)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 6
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="x", top_p=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_n_choices_through_the_openai_client(served):
    """n = 3, completions and chat, streamed and not: choices indexed 0..2, each a whole answer
    (greedy: the one-sample answer three times), usage with the prompt once and every choice's
    tokens; a seeded sampled request repeats its three choices, its choice 0 the answer without n."""
    client = openai.OpenAI(base_url=served[1].url + "/v1", api_key=API_KEY, max_retries=0)
    one = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0)
    three = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert (three.usage.prompt_tokens, three.usage.completion_tokens) == (one.usage.prompt_tokens, 18)
    pieces = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, n=3,
                                            stream=True, stream_options={"include_usage": True}))
    for i in range(3):
        mine = [p.choices[0] for p in pieces if p.choices and p.choices[0].index == i]
        assert "".join(c.text for c in mine) == one.choices[0].text
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert pieces[-1].usage.completion_tokens == 18 and pieces[-1].usage.prompt_tokens == one.usage.prompt_tokens
    messages = [{"role": "user", "content": "Name a colour."}]
    seeded = dict(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=7)
    # The prompt cached on both ranks first, so that every request below finds the same prefix: the
    # draft's cached prompt KV may differ in its last bits from its prefill's, and with it the seeded
    # proposals (and output).
    client.chat.completions.create(**seeded)
    chats = [client.chat.completions.create(**seeded, n=3, extra_body={"return_token_ids": True}) for _ in range(2)]
    alone = client.chat.completions.create(**seeded)
    texts = [c.message.content for c in chats[0].choices]
    assert [c.message.content for c in chats[1].choices] == texts and texts[0] == alone.choices[0].message.content
    assert len(set(texts)) > 1 and [c.index for c in chats[0].choices] == [0, 1, 2]
    assert chats[0].usage.completion_tokens == sum(len(c.token_ids) for c in chats[0].choices)
    chunks = list(client.chat.completions.create(**seeded, n=3, stream=True))
    for i, text in enumerate(texts):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"  # each choice's role comes first
        assert "".join(c.delta.content or "" for c in mine) == text
        assert [c.finish_reason for c in mine if c.finish_reason] == [chats[0].choices[i].finish_reason]


def test_n_choices_each_follow_the_response_format(served):
    """Structured output with n: each sample runs its own grammar state, so every choice is a
    document of the schema (sampled choices differ), streamed or not."""
    client = openai.OpenAI(base_url=served[1].url + "/v1", api_key=API_KEY, max_retries=0)
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    body = dict(model=MODEL, messages=[{"role": "user", "content": "A colour and a number, as JSON."}],
                max_tokens=40, temperature=1.0, seed=3, n=4,
                response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    client.chat.completions.create(**{**body, "n": 1})  # the prompt cached on both ranks (as above)
    done = client.chat.completions.create(**body)
    documents = [json.loads(c.message.content) for c in done.choices]
    for document in documents:
        jsonschema.validate(document, schema)
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 1
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(4)]
    assert [json.loads(t) for t in streamed] == documents  # the seed repeats them


def _offline_logprobs(prompt: list[int], output: list[int]) -> torch.Tensor:
    """The served target's log-softmax at each output position (greedy: the raw logits), from
    one plain forward of the whole text on an executor of its own."""
    target, _ = resolve_models(None, None, None)
    ex = load_executor(target, max_seqs=1, max_seq_len=256)
    ex.add_sequence(0)
    logits = ex.forward([chain_chunk(0, prompt + output[:-1], 0)])[0][len(prompt) - 1:]
    return processed_logprobs(logits[None], [SamplingParams(temperature=0)])[0]


def test_logprobs_through_the_openai_client(served):
    """Completions' and chat's logprobs in OpenAI's shapes, streamed and not, equal to the
    target's log-softmax offline (the forwards differ in shape: fp32 sums in another order)."""
    client = openai.OpenAI(base_url=served[1].url + "/v1", api_key=API_KEY, max_retries=0)
    prompt = "The capital of France is"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                     extra_body={"return_token_ids": True})
    lp = done.choices[0].logprobs
    ids = done.choices[0].token_ids
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) == 8
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    want = _offline_logprobs(done.prompt_token_ids, ids)
    for i, (tok, value, top) in enumerate(zip(ids, lp.token_logprobs, lp.top_logprobs)):
        assert abs(value - float(want[i, tok])) < 1e-4
        assert value == max(top.values())  # greedy: the chosen token is the most likely
        assert 2 <= len(top) <= 3 and top[lp.tokens[i]] == value  # two alternatives and the chosen token
    pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [v for p in pieces if p.choices and p.choices[0].logprobs for v in p.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)  # rounds may differ: fp32 in another order
    offsets = [o for p in pieces if p.choices and p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset  # running on across chunks
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 3
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    assert [c.logprob for k in chunks if k.choices and k.choices[0].logprobs
            for c in k.choices[0].logprobs.content] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


# --- overload and a dead engine (tiny models) ----------------------------------------------------

def test_the_loop_thread_alone_runs_on_the_target_cores(tiny_llm):
    # Before: every thread of the server (uvicorn's too) inherited the target's core, so its HTTP
    # work took turns with the target while other cores were free.
    before = os.sched_getaffinity(0)  # this module's `served` server has moved this thread
    os.sched_setaffinity(0, range(os.cpu_count()))  # the kernel keeps the cores this process may use
    cores = os.sched_getaffinity(0)
    try:
        if len(cores) < 2:
            pytest.skip("one core: nothing to keep apart")
        with tiny_llm() as llm, BackgroundServer(OpenAIServer(llm, "tiny")) as bg:
            target = set(llm.runtime.target_cores)
            assert target and target < cores
            assert os.sched_getaffinity(bg.server.async_llm._thread.native_id) == target
            assert os.sched_getaffinity(bg._thread.native_id) == cores - target  # uvicorn's thread
            assert os.sched_getaffinity(0) == cores - target  # the thread that started the server
            response = httpx.post(bg.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
            assert response.status_code == 200
        assert os.sched_getaffinity(0) == cores  # closing the LLM gave the caller its cores back
    finally:
        os.sched_setaffinity(0, before)


def test_past_the_queue_limit_requests_get_503_overloaded(tiny_llm):
    long = {"prompt": [1, 2, 3], "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    with tiny_llm(max_batch=1) as llm, BackgroundServer(OpenAIServer(llm, "tiny", max_waiting=0)) as bg:
        # The loop holds after its first step (the first request's prefill), so that request is
        # still running whatever the machine's speed when the second one arrives.
        step, steps, go_on = llm.loop.step, [], threading.Event()

        def held():
            if steps:
                go_on.wait(30)
            steps.append(1)
            return step()

        llm.loop.step = held
        with httpx.Client(base_url=bg.url, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                                       json={**long, "stream": True,
                                                                             "return_token_ids": True}) as first:
            # Keep the iterator: a dropped one is closed when collected, which closes the stream,
            # and the server rightly aborts the request of a client that went away.
            lines = first.iter_lines()
            next(lines)  # it runs (no tokenizer: token ids make the chunks)
            r = c.post("/v1/completions", json=long)
            assert r.status_code == 503 and "overloaded" in r.json()["error"]["message"]
            assert c.get("/health").status_code == 200
            go_on.set()
        with httpx.Client(base_url=bg.url, timeout=60) as c:
            deadline = time.monotonic() + 10
            while c.post("/v1/completions", json={**long, "max_tokens": 2}).status_code == 503:
                assert time.monotonic() < deadline  # the first one's client left: its place frees up
                time.sleep(0.05)


def test_a_dead_engine_fails_pending_requests_and_health_turns_503(tiny_llm):
    with tiny_llm() as llm, BackgroundServer(OpenAIServer(llm, "tiny")) as bg:
        step, calls = llm.loop.step, []

        def failing():
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected loop failure")
            return step()

        llm.loop.step = failing
        got = _stream_plain(bg.url, {"prompt": [1, 2, 3], "max_tokens": 50, "temperature": 0})
        assert got.error["code"] == 503 and "injected loop failure" in got.error["message"] and got.done
        health = httpx.get(bg.url + "/health")
        assert health.status_code == 503 and "injected loop failure" in health.json()["error"]["message"]
        r = httpx.post(bg.url + "/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503 and "serving loop failed" in r.json()["error"]["message"]


def _stream_plain(url: str, body: dict) -> Streamed:
    result = Streamed()
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                               json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                add_event(result, line[len("data: "):])
    return result


# --- echo and prompt logprobs --------------------------------------------------------------------


def _offline_prompt_logprobs(prompt: list[int]) -> list:
    """The prompt's logprobs from a separate ar LLM on the served target (its own prefill)."""
    with LLM(mode="ar", launch="local", max_batch=1, max_model_len=256) as llm:
        return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs


def test_echo_and_prompt_logprobs_score_the_prompt(served):
    """echo + logprobs + max_tokens 0 returns the prompt's text and its tokens' logprobs (the
    first null), equal to an offline prefill's; streamed the same; vLLM's prompt_logprobs list."""
    llm, bg = served
    client = openai.OpenAI(base_url=bg.url + "/v1", api_key=API_KEY, max_retries=0)
    prompt = "The capital of France is Paris"
    ids = llm.tokenizer.encode(prompt)
    want = _offline_prompt_logprobs(ids)
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True)
    choice = done.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length" and done.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for value, top, token, w in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], lp.tokens[1:], want[1:]):
        assert abs(value - w.logprob) < 1e-4 and top[token] == value and len(top) <= 2
    pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == prompt
    streamed = [v for p in pieces if p.choices and p.choices[0].logprobs for v in p.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    # Echo with generated tokens: the prompt's entries, then the output's, offsets running on.
    both = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
    assert both.choices[0].text == prompt + plain.choices[0].text
    # The plain request may reuse the cached prompt, equal on torch to a prefill up to rounding.
    assert both.choices[0].logprobs.token_logprobs[len(ids):] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    # vLLM's prompt_logprobs, completions (on the choice) and chat (on the response).
    raw = _complete(httpx.Client(base_url=bg.url, headers=AUTH, timeout=60), prompt=ids, max_tokens=1,
                    prompt_logprobs=2)
    listed = raw["choices"][0]["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None
    for tok, entry, w in zip(ids[1:], listed[1:], want[1:]):
        assert abs(entry[str(tok)]["logprob"] - w.logprob) < 1e-4 and entry[str(tok)]["rank"] == w.rank
        assert 1 <= len(entry) <= 3
    chat = httpx.post(bg.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_loglikelihood_request_as_lm_eval_sends_it(served):
    """lm-evaluation-harness's local-completions loglikelihood: token ids as a batch of one, echo,
    logprobs 1, temperature 0, a seed; it sums token_logprobs[ctxlen:-1] and calls the
    continuation greedy when each is its position's top."""
    llm, bg = served
    context, continuation = llm.tokenizer.encode("Question: 2 + 2 = ?\nAnswer:"), llm.tokenizer.encode(" 4")
    want = _offline_prompt_logprobs(context + continuation)
    for max_tokens in (0, 1):
        with httpx.Client(base_url=bg.url, headers=AUTH, timeout=60) as c:
            out = c.post("/v1/completions", json={"model": MODEL, "prompt": [context + continuation],
                                                  "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
                                                  "seed": 1234, "echo": True})
        assert out.status_code == 200, out.text
        lp = out.json()["choices"][0]["logprobs"]
        end = len(context + continuation)
        got = lp["token_logprobs"][len(context):end]
        assert got == pytest.approx([w.logprob for w in want[len(context):]], abs=1e-4)
        tops = lp["top_logprobs"][len(context):end]
        is_greedy = all(v == max(t.values()) for v, t in zip(got, tops))
        assert is_greedy == all(w.rank == 1 for w in want[len(context):])


def test_a_closed_server_and_llm_hold_no_model_memory(tmp_path):
    """Closing the LLM frees both ranks' models and KV at once, even while something still refers
    to it: FastAPI keeps every route's endpoint (the server's bound methods, so the server and its
    LLM) in a process-wide cache. Measured as the process's resident memory, which the open
    server raises by the default engine's weights and KV."""
    import ctypes
    import gc

    import psutil

    def resident() -> float:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system, as RSS counts it
        return psutil.Process().memory_info().rss

    before = resident()
    with LLM(mode="ssd", launch="local", max_batch=2, max_model_len=256, fanout=(2, 1, 1, 1, 1, 1)) as llm, \
            BackgroundServer(OpenAIServer(llm, MODEL)) as bg:
        openai.OpenAI(base_url=bg.url + "/v1", api_key="none").completions.create(
            model=MODEL, prompt="The cat", max_tokens=4, temperature=0)
        opened = resident()
    closed = resident()
    assert opened - before > 200 * 2**20  # the models are in this process (draft local)
    assert closed - before < 0.25 * (opened - before), (before, opened, closed)
