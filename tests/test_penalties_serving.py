"""Penalties, logit_bias and min_tokens through the OpenAI server over a real socket, with the
official `openai` client: each field changes the answer as its definition says and the answer is
`LLM.generate`'s in ar mode with the same SamplingParams, token for token; out-of-range values and
token ids outside the vocabulary are a 400 naming the field, the server healthy after. The SmolLM2
ggml engine in sd mode (exact rows: sd's greedy output is ar's), its draft in this process."""

from __future__ import annotations

import json
import math
import re

import httpx
import openai
import pytest

from trtssd import LLM, SamplingParams
from trtssd.build import build_engine
from trtssd.serving.openai_server import OpenAIServer
from trtssd.serving.uvicorn_runner import BackgroundServer

pytestmark = [pytest.mark.slow]

MODEL = "smol"
PROMPT = "1, 2, 1, 2, 1, 2, 1, 2,"  # greedy repeats it: penalties have something to change
ASK = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
LENGTH = 12


@pytest.fixture(scope="module")
def engine():
    return build_engine("smollm2-135m", backend="ggml", progress=False)


def ar_answers(engine, prompt: str, length: int, settings: dict[str, dict]) -> tuple[dict[str, list[int]], int]:
    """Greedy token ids of LLM.generate in ar mode, plain (under "plain") and with each setting's
    SamplingParams fields; and the model's vocabulary size."""
    with LLM(str(engine), mode="ar", launch="local", max_batch=2, max_model_len=512) as llm:
        answers = {name: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=length, **fields))[0].token_ids
                   for name, fields in {"plain": {}, **settings}.items()}
        return answers, llm.loop.target.vocab_size


@pytest.fixture(scope="module")
def reference(engine):
    """ar's greedy answers, plain and with each setting the tests send."""
    plain = ar_answers(engine, PROMPT, LENGTH, {})[0]["plain"]
    favoured = plain[0] + 1
    settings = {
        "penalties": dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
        "ban": dict(logit_bias={plain[0]: -100}),
        "favour": dict(logit_bias={favoured: 100}),
    }
    outputs = ar_answers(engine, PROMPT, LENGTH, settings)[0]
    return outputs.pop("plain"), favoured, settings, outputs


@pytest.fixture(scope="module")
def served(engine):
    with LLM(str(engine), mode="sd", launch="local", max_batch=4, max_model_len=512) as llm:
        with BackgroundServer(OpenAIServer(llm, MODEL)) as bg:
            yield bg


def _client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


def test_penalties_and_logit_bias_through_the_openai_client_are_ar_s_answers(served, reference):
    plain, favoured, settings, outputs = reference
    client = _client(served)
    for name, s in settings.items():
        fields = dict(s)
        bias = fields.pop("logit_bias", None)
        extra = {"return_token_ids": True, **({"repetition_penalty": fields.pop("repetition_penalty")}
                                              if "repetition_penalty" in fields else {})}
        done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LENGTH, temperature=0,
                                         logit_bias={str(t): b for t, b in (bias or {}).items()} or None,
                                         extra_body=extra, **fields)
        assert done.choices[0].token_ids == outputs[name], name
        assert outputs[name] != plain, name
    assert outputs["ban"][0] != plain[0] and set(outputs["favour"]) == {favoured}


def test_min_tokens_keeps_a_short_chat_answer_going(served):
    client = _client(served)
    short = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    longer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                            extra_body={"min_tokens": 25})
    assert longer.usage.completion_tokens >= 25
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)
    # A stop string the answer starts with ends it at once, unless min_tokens holds it back (vLLM's rule).
    stop = short.choices[0].message.content[:3]
    cut = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "stop"
    kept = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, stop=[stop],
                                          extra_body={"min_tokens": 25})
    assert kept.usage.completion_tokens >= 25 and kept.choices[0].message.content.startswith(stop)
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, stream=True,
                                              presence_penalty=0.5, frequency_penalty=0.5,
                                              extra_body={"min_tokens": 25})
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                           presence_penalty=0.5, frequency_penalty=0.5, extra_body={"min_tokens": 25})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.choices[0].message.content


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty", r"'presence_penalty' must be a number in \[-2, 2\]"),
    ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty", r"'frequency_penalty' must be a number"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", r"'repetition_penalty' must be a number in \[0.01, 100\]"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias", "'logit_bias.5': Input should be less than or equal"),
    ("/v1/chat/completions", {"logit_bias": {"five": 1}}, "logit_bias", "'logit_bias' keys must be token ids"),
    ("/v1/completions", {"logit_bias": {"-5": 1}}, "logit_bias", "'logit_bias' keys must be token ids"),
    ("/v1/completions", {"logit_bias": {str(t): 1 for t in range(1025)}}, "logit_bias", "at most 1024 token ids"),
    ("/v1/completions", {"logit_bias": {"49152": 1}}, "logit_bias", r"token ids must be in \[0, 49152\)"),
    ("/v1/chat/completions", {"logit_bias": {"3": 1, "99999": -1}}, "logit_bias", r"\[0, 49152\).*99999"),
    ("/v1/completions", {"repetition_penalty": 0.001}, "repetition_penalty", r"must be a number in \[0.01, 100\]"),
    ("/v1/chat/completions", {"repetition_penalty": 1e5}, "repetition_penalty", r"must be a number in \[0.01, 100\]"),
    ("/v1/completions", {"logit_bias": {"7": 1, "007": -1}}, "logit_bias", "names token 7 more than once"),
    ("/v1/completions", {"logit_bias": {"9" * 5000: 1}}, "logit_bias", "'logit_bias' keys must be token ids"),
    # min_tokens holds stop tokens back by indexing the logits with them: an id past them is refused.
    ("/v1/completions", {"stop_token_ids": [49152], "min_tokens": 1}, "stop_token_ids", r"\[0, 49152\)"),
    ("/v1/chat/completions", {"stop_token_ids": [10**6]}, "stop_token_ids", r"\[0, 49152\)"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 4}, "min_tokens", r"min_tokens must be an int in \[0, max"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens", "'min_tokens' must be an integer >= 0"),
])
def test_bad_values_are_a_400_naming_the_field(served, path, body, param, message):
    payload = {"model": MODEL, "max_tokens": 4, **body}
    payload |= {"messages": ASK} if "chat" in path else {"prompt": PROMPT}
    with httpx.Client(base_url=served.url, timeout=60) as client:
        r = client.post(path, json=payload)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and re.search(message, error["message"]), error
        assert client.get("/health").status_code == 200


def test_the_openai_client_gets_the_400_with_its_param(served):
    with pytest.raises(openai.BadRequestError) as err:
        _client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={"60000": -100})
    assert err.value.body["param"] == "logit_bias"


def _strict_json(text: str):
    """JSON as the standard defines it: NaN and Infinity, which Python's parser reads, refused."""
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_every_token_is_banned_and_minus_inf_logprobs_are_clean_json(served, stream):
    """Every token a stop token under min_tokens: the first position bans nothing (it would ban
    everything), so the answer is one stop token with a finite logprob (before: NaN, a 500 or a
    stream of non-JSON, sampling from no mass). An echoed prompt token outside top-k has logprob
    -inf, sent as vLLM's -9999.0. The server is healthy after both."""
    with httpx.Client(base_url=served.url, timeout=120) as client:
        for temperature in (0, 1.0):
            r = client.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "min_tokens": 2, "temperature": temperature,
                "stop_token_ids": list(range(49152)), "logprobs": 1, "return_token_ids": True, "stream": stream})
            assert r.status_code == 200, r.text
            bodies = [_strict_json(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")] if stream else [_strict_json(r.text)]
            choices = [c for body in bodies for c in body["choices"]]
            assert sum(len(c["token_ids"]) for c in choices) == 1 and choices[-1]["finish_reason"] == "stop"
            assert all(math.isfinite(v) for c in choices if c["logprobs"] for v in c["logprobs"]["token_logprobs"])
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "top_k": 1,
                                                 "echo": True, "logprobs": 1, "stream": stream})
        assert r.status_code == 200, r.text
        bodies = [_strict_json(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")] if stream else [_strict_json(r.text)]
        scored = [v for body in bodies for c in body["choices"] if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert scored[0] is None and min(scored[1:]) == -9999.0  # the echoed prompt's, then the token's
        assert client.get("/health").json()["status"] == "ok"
