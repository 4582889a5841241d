"""Structured outputs through the OpenAI server, over a real socket: response_format json_schema
and json_object, vLLM's structured_outputs (json, regex, choice, grammar) and its older guided_*
fields, streamed and not, with the `openai` client too; every bad constraint a 400 naming its
field, the server healthy after. The SmolLM2 ggml engine in sd mode, its draft in this process."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from sse_client import stream_request
from trtssd import LLM
from trtssd.build import build_engine
from trtssd.serving.openai_server import OpenAIServer
from trtssd.serving.uvicorn_runner import BackgroundServer

pytestmark = [pytest.mark.slow]

MODEL = "smol"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and role."}]
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def served():
    engine = build_engine("smollm2-135m", backend="ggml", progress=False)
    with LLM(str(engine), mode="sd", launch="local", max_batch=4, max_model_len=512) as llm:
        with BackgroundServer(OpenAIServer(llm, MODEL)) as bg:
            yield bg


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


def _post(client, path: str, **body) -> dict:
    r = client.post(path, json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _text(out: dict) -> str:
    choice = out["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _streamed(url: str, path: str, body: dict):
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await stream_request(c, path, {"model": MODEL, "temperature": 0, **body})

    return asyncio.run(run())


# --- constraints that work ------------------------------------------------------------------------

def test_json_schema_output_validates_streamed_or_not(served, client):
    body = {"messages": ASK, "max_tokens": 80,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                         "strict": True}}}
    out = _post(client, CHAT, **body)
    assert out["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(_text(out)), PERSON)
    streamed = _streamed(served.url, CHAT, body)
    assert streamed.done and streamed.text == _text(out) and streamed.finish_reason == "stop"


def test_json_object_on_completions_parses(client):
    out = _post(client, COMPLETION, prompt="A JSON object describing a cat:", max_tokens=80,
                response_format={"type": "json_object"})
    assert out["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(_text(out)), dict)


@pytest.mark.parametrize("field, value, check", [
    ("regex", r"[0-9]{3}-[0-9]{4}", lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ("choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
    ("grammar", 'root ::= "The answer is " ("yes" | "no") "."', lambda t: t in ("The answer is yes.",
                                                                             "The answer is no.")),
    ("json", json.dumps(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_structured_outputs_fields(client, field, value, check):
    out = _post(client, COMPLETION, prompt="Answer:", max_tokens=60, structured_outputs={field: value})
    assert out["choices"][0]["finish_reason"] == "stop" and check(_text(out)), _text(out)


def test_vllms_older_guided_fields(client):
    out = _post(client, CHAT, messages=ASK, max_tokens=10, guided_choice=["yes", "no"])
    assert _text(out) in ("yes", "no")
    out = _post(client, COMPLETION, prompt="Year:", max_tokens=10, guided_regex="(19|20)[0-9]{2}")
    assert re.fullmatch("(19|20)[0-9]{2}", _text(out))


def test_the_openai_client_sends_response_format_and_extra_body(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none")
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=5, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert out.choices[0].text in ("left", "right")


def test_a_document_cut_by_max_tokens_ends_with_length(client):
    out = _post(client, CHAT, messages=ASK, max_tokens=3,
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert out["choices"][0]["finish_reason"] == "length"


# --- bad constraints ------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format", "invalid json_schema"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format", "'response_format' must be an object {type: "
     "'text' | 'json_object' | 'json_schema'"),
    (COMPLETION, {"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "invalid regex"),
    (COMPLETION, {"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs",
     "invalid grammar"),
    (COMPLETION, {"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    (COMPLETION, {"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    (COMPLETION, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    (COMPLETION, {"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown field"),
    (COMPLETION, {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "one constraint; got 'response_format' and 'guided_regex'"),
    (COMPLETION, {"guided_grammar": "root ::= ("}, "guided_grammar", "invalid grammar"),
    (COMPLETION, {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos",
     "cannot be combined with a constraint"),
    (CHAT, {"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs 'tools'"),
    (CHAT, {"tools": [TOOL]}, "tools", "chat template does not render 'tools'"),
    (CHAT, {"tools": [{"type": "function"}]}, "tools", r"'tools\[0\]\.function'"),
    (CHAT, {"tool_choice": "sometimes"}, "tool_choice", "'tool_choice' must be 'none', 'auto'"),
]


def _send_bad(client, path: str, body: dict) -> httpx.Response:
    prompt = {"messages": MSG} if path == CHAT else {"prompt": "hi"}
    return client.post(path, json={"model": MODEL, "max_tokens": 4, **prompt, **body})


@pytest.mark.parametrize("path, body, param, match", BAD)
def test_bad_constraints_get_a_400_naming_the_field(client, path, body, param, match):
    r = _send_bad(client, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    assert re.search(match, error["message"]), error["message"]
    assert client.get("/health").status_code == 200


def test_the_server_answers_normally_after_bad_constraints(client):
    for path, body, _, _ in BAD:
        assert _send_bad(client, path, body).status_code == 400
    out = _post(client, COMPLETION, prompt="Hello", max_tokens=3)
    assert out["usage"]["completion_tokens"] == 3
    out = _post(client, COMPLETION, prompt="Pick:", max_tokens=5, structured_outputs={"choice": ["a", "b"]})
    assert _text(out) in ("a", "b")
