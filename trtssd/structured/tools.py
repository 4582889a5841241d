"""Tool calls: definitions rendered through the model's chat template, the model's call format as
a grammar (so forced calls always parse and their arguments follow each function's schema), and
the model's text parsed back into calls, whole or as it streams.

The format-specific parts sit behind `ToolFormat`; the one supported is Hermes-style, which
Qwen2.5's template asks for: each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
several separated by a newline. A model whose chat template takes no ``tools`` (or asks for
another format) is refused with `ToolsUnsupported` rather than served calls it was never shown.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from trtssd.structured.grammar import JSON_SEPARATORS

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI's meaning of a function without parameters


class ToolsUnsupported(ValueError):
    """The model's chat template cannot show tools, or asks for a call format not supported."""


@dataclass(frozen=True)
class ToolFunction:
    """One function the model may call: its name, description and parameters (a JSON schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS

    def as_openai(self) -> dict[str, Any]:
        """The definition as OpenAI's ``tools`` item, the shape chat templates render."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: ``arguments`` is JSON text (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        return {**out, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class TextPiece:
    """Text of the answer outside any call."""

    text: str


Piece = TextPiece | ToolCall


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text outside calls; None when there is none
    calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --- the Hermes / Qwen2.5 format -----------------------------------------------------------------

class HermesFormat:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, calls separated by "\\n"."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    separator = "\n"

    def call_grammar(self, functions: Sequence[ToolFunction], parallel: bool) -> str:
        """EBNF (xgrammar's dialect) of one call (``parallel`` False) or one or more calls, each of
        one of ``functions`` with arguments that follow its parameter schema."""
        xgr = _xgrammar()
        calls = [xgr.Grammar.concat(_literal(f'{self.open_tag}\n{{"name": {json.dumps(f.name)}, "arguments": '),
                                    _schema_grammar(f.schema),
                                    _literal(f"}}\n{self.close_tag}")) for f in functions]
        one = xgr.Grammar.union(*calls) if len(calls) > 1 else calls[0]
        if not parallel:
            return str(one)
        return _repeated(str(one), self.separator)

    def parse_body(self, body: str) -> ToolCall | None:
        """A call's JSON, or None when it is not ``{"name": str, "arguments": object}``."""
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string already
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(new_call_id(), call["name"], json.dumps(arguments, ensure_ascii=False))

    def stream_parser(self, max_calls: int | None = None) -> "ToolStreamParser":
        return ToolStreamParser(self, max_calls)


FORMATS = {"hermes": HermesFormat()}


def tool_format(tokenizer: Any) -> HermesFormat:
    """The call format the model's chat template asks for; ToolsUnsupported when it takes no
    ``tools`` or asks for a format not supported here."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not isinstance(template, str) or not template:
        raise ToolsUnsupported("this model has no chat template, so it cannot be shown tools")
    if "tools" not in template:
        raise ToolsUnsupported("this model's chat template does not render 'tools': the model was not trained to "
                               "call them; send the request without 'tools'")
    if HermesFormat.open_tag not in template:
        raise ToolsUnsupported("this model's chat template asks for a tool-call format that is not supported "
                               f"(supported: {', '.join(FORMATS)}, the <tool_call> JSON format of Qwen2.5 and Hermes)")
    return FORMATS["hermes"]


# --- parsing, whole or streamed ------------------------------------------------------------------

class ToolStreamParser:
    """Splits a model's text, fed piece by piece, into text and calls, in order.

    Text that may be the start of a call's opening tag is held until it is known not to be; a
    call is given out whole once its closing tag arrives (or at `finish`, when the output ended
    inside it). Trailing whitespace is held too, and dropped at a call (and at the end of an
    answer that made calls), so the newlines between and around calls are not answered as
    content; the same text fed whole or in any pieces splits the same way. A call whose body is not a call's
    JSON is given out as text, as the model wrote it. ``max_calls``: calls past it are dropped
    (parallel_tool_calls false)."""

    def __init__(self, fmt: HermesFormat, max_calls: int | None = None):
        self.fmt = fmt
        self.max_calls = max_calls
        self.num_calls = 0
        self._buffer = ""
        self._in_call = False
        self._space = ""  # whitespace held: given out only when text follows it

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while True:
            tag = self.fmt.close_tag if self._in_call else self.fmt.open_tag
            at = self._buffer.find(tag)
            if at < 0:
                break
            before, self._buffer = self._buffer[:at], self._buffer[at + len(tag):]
            if self._in_call:
                out += self._call(before)
            else:
                out += self._text(before)
                self._space = ""
            self._in_call = not self._in_call
        if not self._in_call:
            keep = _partial_suffix(self._buffer, self.fmt.open_tag)
            text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            out += self._text(text)
        return out

    def finish(self) -> list[Piece]:
        """What is held at the end of the output: an unclosed call (parsed if it can be) or text."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            return self._call(rest, unclosed=True)
        out = self._text(rest)
        held, self._space = self._space, ""
        if held and not self.num_calls:  # a text answer keeps its whitespace; around calls it is dropped
            out.append(TextPiece(held))
        return out

    def _text(self, text: str) -> list[Piece]:
        """Text, less its trailing whitespace, which is held until more text follows."""
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        held, self._space = self._space, text[len(body):]
        return [TextPiece(held + body)]

    def _call(self, body: str, unclosed: bool = False) -> list[Piece]:
        call = self.fmt.parse_body(body.strip())
        if call is None:
            raw = self.fmt.open_tag + body + ("" if unclosed else self.fmt.close_tag)
            return [TextPiece(raw)]
        self._space = ""
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return []
        self.num_calls += 1
        return [call]


def parse_tool_calls(text: str, fmt: HermesFormat, max_calls: int | None = None) -> ParsedOutput:
    """A whole answer's text and calls (the same split as streaming it gives)."""
    parser = fmt.stream_parser(max_calls)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p.text for p in pieces if isinstance(p, TextPiece))
    return ParsedOutput(content or None, tuple(p for p in pieces if isinstance(p, ToolCall)))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# --- chat history -------------------------------------------------------------------------------

def template_tool_calls(calls: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` as chat templates render them: arguments as
    an object, not JSON text (Qwen2.5's template writes them with ``tojson``). ValueError when
    an arguments string is not a JSON object."""
    out = []
    for i, call in enumerate(calls):
        function = call["function"]
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"tool_calls[{i}].function.arguments is not valid JSON: {err}") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# --- schemas and grammars ------------------------------------------------------------------------

def check_parameters(schema: Any) -> None:
    """A function's parameters must be a JSON schema (by its meta-schema) describing an object;
    ValueError saying what is wrong."""
    if not isinstance(schema, dict):
        raise ValueError(f"must be a JSON schema object; got {json.dumps(schema)[:100]}")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        raise ValueError(f"is not a valid JSON schema at {where}: {err.message}") from None
    kind = schema.get("type", "object")
    if kind != "object" and kind != ["object"]:
        raise ValueError(f"must describe an object (type 'object'): a call's arguments are one; got type {kind!r}")


def _xgrammar():
    import xgrammar

    return xgrammar


def _literal(text: str):
    return _xgrammar().Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _schema_grammar(schema: dict[str, Any]):
    return _xgrammar().Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=JSON_SEPARATORS, strict_mode=True)


_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", re.MULTILINE)


def _repeated(ebnf: str, separator: str) -> str:
    """A grammar of one or more of ``ebnf``'s root, separated by ``separator``. The root rule is
    renamed to a name no rule has; nothing refers to a composed grammar's root (xgrammar gives
    the parts' own roots new names), so renaming its definition is enough."""
    names = set(_RULE.findall(ebnf))
    one = "tool_call"
    while one in names:
        one += "_"
    body = re.sub(r"^root ::=", f"{one} ::=", ebnf, count=1, flags=re.MULTILINE)
    return f"root ::= {one} ({json.dumps(separator)} {one})*\n{body}"
