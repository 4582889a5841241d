"""Guided decoding on the Triton model: the inputs TensorRT-LLM's backend names
(guided_decoding_guide_type json / json_schema / regex / ebnf_grammar, guided_decoding_guide)
parsed into constraints, bad ones refused by name; then on a real tritonserver (the SmolLM2
ggml engine in ar mode) through tritonclient's gRPC stream and the HTTP generate endpoint, an
invalid guide an error naming the input, and the server ready after."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from test_triton import FakeTokenizer, _inputs, _joined, grpc_stream, server_test
from trtssd.cli import main as cli_main
from trtssd.structured.constraint import Constraint
from trtssd.triton.repository import config_pbtxt
from trtssd.triton.server import Ports, TritonServer
from trtssd.triton.triton_requests import parse_request

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "count": {"type": "integer"}},
          "required": ["colour", "count"]}


def _constraint(**values):
    return parse_request(_inputs(text_input="hi", **values), {}, FakeTokenizer()).params.constraint


@pytest.mark.parametrize("kind, guide, expected", [
    ("json", None, Constraint.json_object()),
    ("json_schema", json.dumps(SCHEMA), Constraint.json_schema(SCHEMA)),
    ("regex", "[a-z]+", Constraint.regex("[a-z]+")),
    ("ebnf_grammar", 'root ::= "a"', Constraint.grammar('root ::= "a"')),
])
def test_guide_types_become_constraints(kind, guide, expected):
    given = {"guided_decoding_guide_type": kind} | ({} if guide is None else {"guided_decoding_guide": guide})
    assert _constraint(**given) == expected
    assert _constraint() is None


@pytest.mark.parametrize("values, match", [
    ({"guided_decoding_guide_type": "structural_tag", "guided_decoding_guide": "{}"}, "structural_tag is not supported"),
    ({"guided_decoding_guide_type": "xml"}, "must be one of json, json_schema, regex, ebnf_grammar; got 'xml'"),
    ({"guided_decoding_guide": "[a-z]"}, "'guided_decoding_guide' needs 'guided_decoding_guide_type'"),
    ({"guided_decoding_guide_type": "regex"}, "regex needs 'guided_decoding_guide'"),
    ({"guided_decoding_guide_type": "json", "guided_decoding_guide": "{}"}, "not used with"),
    ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{oops"}, "invalid 'guided_decoding_guide'"),
    ({"guided_decoding_guide_type": "json", "ignore_eos": True}, "ignore_eos"),
])
def test_bad_guides_are_refused_by_name(values, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        _constraint(**values)


def test_config_lists_the_guided_decoding_inputs():
    text = config_pbtxt()
    for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
        assert re.search(rf'name: "{name}" data_type: TYPE_STRING dims: \[ 1 \] optional: true', text)


# --- a real server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from trtssd.build import build_engine

    engine = build_engine("smollm2-135m", backend="ggml", progress=False)
    repo = tmp_path_factory.mktemp("triton-structured")
    assert cli_main(["triton-repo", "--out", str(repo), "--engine", str(engine), "--mode", "ar", "--max-batch", "2",
                     "--max-model-len", "256"]) == 0
    with TritonServer(repo, Ports(0, 0, 0), log_path=repo / "server.log") as triton:
        triton.wait_ready(600)
        yield SimpleNamespace(http=triton.http_url, grpc=f"127.0.0.1:{triton.ports.grpc}")


@server_test
def test_json_schema_and_regex_through_grpc_streams(server):
    responses = grpc_stream(server, text_input="A JSON object:", stream=True, temperature=0.0, max_tokens=60,
                            guided_decoding_guide_type="json_schema", guided_decoding_guide=json.dumps(SCHEMA))
    text, _ = _joined(responses)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert responses[-1].as_numpy("finish_reason")[0].decode() == "stop"
    responses = grpc_stream(server, text_input="Code:", temperature=0.0, max_tokens=12,
                            guided_decoding_guide_type="regex", guided_decoding_guide="[A-Z]{2}-[0-9]{3}")
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", _joined(responses)[0].removeprefix("Code:"))


@server_test
def test_http_generate_with_a_grammar_and_json(server):
    with httpx.Client(base_url=server.http, timeout=120) as client:
        r = client.post("/v2/models/trtssd/generate",
                        json={"text_input": "Answer:", "max_tokens": 8, "temperature": 0, "exclude_input_in_output": True,
                              "guided_decoding_guide_type": "ebnf_grammar",
                              "guided_decoding_guide": 'root ::= "yes" | "no"'})
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] in ("yes", "no")
        r = client.post("/v2/models/trtssd/generate",
                        json={"text_input": "A JSON object:", "max_tokens": 60, "temperature": 0,
                              "exclude_input_in_output": True, "guided_decoding_guide_type": "json"})
        assert r.status_code == 200 and isinstance(json.loads(r.json()["text_output"]), dict), r.text


@server_test
def test_bad_guides_get_errors_naming_the_input_and_the_server_stays_ready(server):
    bad = [({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[0-9"}, "invalid 'guided_decoding_guide'"),
           ({"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": "root ::= nothing"},
            "invalid 'guided_decoding_guide'"),
           ({"guided_decoding_guide_type": "structural_tag", "guided_decoding_guide": "{}"}, "structural_tag")]
    with httpx.Client(base_url=server.http, timeout=60) as client:
        for body, message in bad:
            r = client.post("/v2/models/trtssd/generate", json={"text_input": "hi", "max_tokens": 4, **body})
            assert r.status_code == 400 and message in r.json()["error"], (body, r.text)
        assert client.get("/v2/health/ready").status_code == 200
    ok = grpc_stream(server, text_input="Hello", temperature=0.0, max_tokens=2)
    assert len(_joined(ok)[1]) == 2
