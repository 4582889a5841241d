"""Tool calls: the Hermes / Qwen2.5 format's parser on fixed texts, whole and streamed in pieces;
its call grammar against the Qwen tokenizer (the calls it must take and those it must not); and
the OpenAI server on the Qwen2.5-Coder ggml pair, through the `openai` client, streamed and not:
tool_choice required, a named function, auto, and a history with calls and tool results."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from trtssd import LLM
from trtssd.build import build_engine
from trtssd.models.tokenizer import load_tokenizer
from trtssd.serving.openai_server import OpenAIServer
from trtssd.serving.uvicorn_runner import BackgroundServer
from trtssd.structured.constraint import Constraint
from trtssd.structured.grammar import Grammars
from trtssd.structured.tools import (HermesFormat, TextPiece, ToolCall, ToolFunction, ToolsUnsupported,
                                     check_parameters, parse_tool_calls, template_tool_calls, tool_format)

HERMES = HermesFormat()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTIONS = [ToolFunction("get_weather", "Current weather in a city", WEATHER),
             ToolFunction("get_time", "Current time in a city", TIME)]
TOOLS = [f.as_openai() for f in FUNCTIONS]
SCHEMAS = {f.name: f.schema for f in FUNCTIONS}


def _call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


PARIS = _call("get_weather", {"city": "Paris", "unit": "celsius"})
TOKYO = _call("get_time", {"city": "Tokyo"})


# --- the parser on fixed texts --------------------------------------------------------------------

def test_one_call_is_parsed_with_its_arguments_as_json_text():
    parsed = parse_tool_calls(PARIS, HERMES)
    assert parsed.content is None and len(parsed.calls) == 1
    call = parsed.calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert call.id.startswith("call_") and call.as_openai()["type"] == "function"


def test_several_calls_and_text_before_them():
    parsed = parse_tool_calls(f"Let me check.\n{PARIS}\n{TOKYO}\n", HERMES)
    assert parsed.content == "Let me check." and [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert len({c.id for c in parsed.calls}) == 2
    assert [c.name for c in parse_tool_calls(f"{PARIS}\n{TOKYO}", HERMES, max_calls=1).calls] == ["get_weather"]


@pytest.mark.parametrize("text, content, names", [
    ("Just text, no call.\n", "Just text, no call.\n", []),
    ("a <tool", "a <tool", []),  # a partial tag at the end is text
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ('<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}', None, ["get_time"]),  # unclosed at the end
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>', None,
     ["get_time"]),  # arguments written as a JSON string
])
def test_texts_that_are_not_all_calls(text, content, names):
    parsed = parse_tool_calls(text, HERMES)
    assert parsed.content == content and [c.name for c in parsed.calls] == names


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streaming_in_pieces_gives_what_parsing_the_whole_does(size):
    text = f"Sure: {PARIS}\n{TOKYO}"
    parser = HERMES.stream_parser()
    pieces = []
    for i in range(0, len(text), size):
        pieces += parser.feed(text[i:i + size])
    pieces += parser.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == "Sure:"
    whole = parse_tool_calls(text, HERMES)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    assert not any("<" in p.text for p in pieces if isinstance(p, TextPiece))  # no tag leaked as content


def test_history_calls_are_rendered_with_object_arguments():
    calls = template_tool_calls([{"id": "call_1", "type": "function",
                                  "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}])
    assert calls[0]["function"]["arguments"] == {"city": "Oslo"}
    with pytest.raises(ValueError, match="not valid JSON"):
        template_tool_calls([{"function": {"name": "f", "arguments": "{oops"}}])


@pytest.mark.parametrize("schema, match", [
    ({"type": "object", "properties": {"x": {"type": "strin"}}}, "not a valid JSON schema at properties/x/type"),
    ({"type": "array"}, "must describe an object"),
    ("a string", "must be a JSON schema object"),
])
def test_parameters_that_are_not_an_object_schema(schema, match):
    with pytest.raises(ValueError, match=match):
        check_parameters(schema)


# --- the call grammar on Qwen's tokenizer ----------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_engine():
    return build_engine("qwen2.5-coder-1.5b", backend="ggml", progress=False)


@pytest.fixture(scope="module")
def qwen_grammars(qwen_engine):
    tokenizer = load_tokenizer(qwen_engine / "tokenizer")
    return tokenizer, Grammars(tokenizer, len(tokenizer))


def _accepts(grammars: Grammars, tokenizer, ebnf: str, text: str) -> bool:
    state = grammars.start(Constraint.grammar(ebnf))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return state.advance(ids) == len(ids) and state.accept(tokenizer.convert_tokens_to_ids("<|im_end|>"))


def test_the_call_grammar_takes_calls_that_follow_the_schemas(qwen_grammars):
    tokenizer, grammars = qwen_grammars
    assert tool_format(tokenizer) is not None
    parallel = HERMES.call_grammar(FUNCTIONS, parallel=True)
    single = HERMES.call_grammar(FUNCTIONS, parallel=False)
    named = HERMES.call_grammar(FUNCTIONS[1:], parallel=False)
    assert _accepts(grammars, tokenizer, single, PARIS)
    assert _accepts(grammars, tokenizer, parallel, f"{PARIS}\n{TOKYO}")
    assert not _accepts(grammars, tokenizer, single, f"{PARIS}\n{TOKYO}")  # one call only
    assert not _accepts(grammars, tokenizer, named, PARIS)  # not the named function
    assert not _accepts(grammars, tokenizer, single, _call("get_weather", {"city": "Paris", "unit": "kelvin"}))
    assert not _accepts(grammars, tokenizer, single, _call("get_weather", {"city": "Paris"}))  # required unit
    assert not _accepts(grammars, tokenizer, single, "Sure! " + PARIS)


def test_a_template_without_tools_is_refused():
    class NoTools:
        chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    with pytest.raises(ToolsUnsupported, match="does not render 'tools'"):
        tool_format(NoTools())


# --- the server on the Qwen pair (1.5B on 2 cores: few, short requests) ----------------------------

QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def qwen_server(qwen_engine):
    with LLM(str(qwen_engine), mode="sd", launch="local", max_batch=2, max_model_len=1024) as llm:
        with BackgroundServer(OpenAIServer(llm, "qwen")) as bg:
            yield openai.OpenAI(base_url=bg.url + "/v1", api_key="none")


def _validated(calls) -> list:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.slow
def test_required_gives_calls_whose_arguments_validate(qwen_server):
    out = qwen_server.chat.completions.create(model="qwen", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=60)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _validated(choice.message.tool_calls)
    assert len(calls) >= 1 and calls[0].id.startswith("call_") and calls[0].type == "function"


@pytest.mark.slow
def test_a_named_function_streamed_as_delta_tool_calls(qwen_server):
    stream = qwen_server.chat.completions.create(
        model="qwen", messages=QUESTION, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, temperature=0, max_tokens=60, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        deltas += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [d.index for d in deltas] == [0]
    assert deltas[0].function.name == "get_time" and deltas[0].id.startswith("call_")
    jsonschema.validate(json.loads(deltas[0].function.arguments), TIME)


@pytest.mark.slow
def test_auto_returns_calls_or_text_and_a_history_with_calls_is_taken(qwen_server):
    """auto on this model may or may not call: whichever it wrote is answered in its own shape.
    Then the conversation goes on with the call and its result in the history."""
    system = {"role": "system", "content": "Answer by calling a function."}
    out = qwen_server.chat.completions.create(model="qwen", messages=[system, *QUESTION], tools=TOOLS,
                                              temperature=0, max_tokens=24)
    choice = out.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _validated(choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]
    out = qwen_server.chat.completions.create(model="qwen", messages=history, tools=TOOLS, tool_choice="none",
                                              temperature=0, max_tokens=8)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
