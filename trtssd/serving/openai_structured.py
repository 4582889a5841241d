"""Structured outputs and tools in OpenAI requests: the fields, and what they ask of the engine.

Constraints come by OpenAI's ``response_format`` (``json_object``, ``json_schema``), by vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and by
vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; chat
requests also by ``tools`` with ``tool_choice`` "required" or a named function (a grammar of the
model's call format: `trtssd.structured.tools`). A request has at most one constraint: two are a
400 naming both fields. Each error names the field as the user sent it.

`StructuredFields.structured` turns the fields into a `Structured`: the `Constraint` (for
SamplingParams), the field it came from (for the grammar compiler's errors, at admission) and
the tool calls to parse out of the answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from trtssd.serving.openai_body import ApiError, Body
from trtssd.structured.constraint import Constraint, ConstraintError
from trtssd.structured.tools import (HermesFormat, ToolFunction, ToolsUnsupported, check_parameters,
                                     tool_format)

TOOL_CHOICES = ("none", "auto", "required")


# --- response_format and structured_outputs ------------------------------------------------------

class JsonSchemaSpec(Body):
    name: Optional[str] = Field(None, description="a string: the schema's name (unused)")
    description: Optional[str] = Field(None, description="a string: what the schema is for (unused)")
    schema_: Union[dict[str, Any], bool] = Field(alias="schema", description="a JSON schema object")
    strict: Optional[bool] = Field(None, description="a boolean; the output always follows the schema")


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    json_: Optional[Union[dict[str, Any], bool, str]] = Field(
        None, alias="json", description="a JSON schema (an object, or its JSON text)")
    regex: Optional[str] = Field(None, description="a regular expression the whole output matches")
    choice: Optional[list[str]] = Field(None, description="a list of strings: the output is one of them")
    grammar: Optional[str] = Field(None, description="a context-free grammar in EBNF (xgrammar's dialect, root rule "
                                                     "'root')")
    json_object: Optional[bool] = Field(None, description="true: any JSON object")


# --- tools ---------------------------------------------------------------------------------------

class FunctionDef(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$",
                      description="a function name: letters, digits, '_', '.', '-', at most 64")
    description: Optional[str] = Field(None, description="a string: what the function does")
    parameters: Optional[Any] = Field(None, description="a JSON schema of the arguments object")
    strict: Optional[bool] = Field(None, description="a boolean; forced calls always follow the schema")


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


@dataclass(frozen=True)
class ToolParsing:
    """How to read calls out of an answer: the model's format, and at most how many to keep."""

    format: HermesFormat
    max_calls: int | None  # None: any number (parallel_tool_calls)


@dataclass(frozen=True)
class Structured:
    """What a request's structured-output and tool fields ask of the engine."""

    constraint: Constraint | None = None
    param: str | None = None  # the field the constraint came from, as sent
    tools: tuple[dict[str, Any], ...] | None = None  # definitions for the chat template (None: none)
    parsing: ToolParsing | None = None  # calls to parse out of the answer (None: text only)


# The fields as the routes declare them (descriptions start with the values they allow).
RESPONSE_FORMAT = Field(None, description="an object {type: 'text' | 'json_object' | 'json_schema', json_schema?: "
                                          "{name, schema, strict, description}}")
STRUCTURED_OUTPUTS = Field(None, description="an object with one of json (a schema), regex, choice, grammar, "
                                             "json_object (vLLM's)")
GUIDED = {"guided_json": "a JSON schema (an object or its JSON text): vLLM's older name for structured_outputs.json",
          "guided_regex": "a regular expression: vLLM's older name for structured_outputs.regex",
          "guided_choice": "a list of strings: vLLM's older name for structured_outputs.choice",
          "guided_grammar": "an EBNF grammar: vLLM's older name for structured_outputs.grammar"}


class StructuredFields(Body):
    """The constraint fields both routes take; the chat route adds the tool fields."""

    response_format: Optional[ResponseFormat] = RESPONSE_FORMAT
    structured_outputs: Optional[StructuredOutputs] = STRUCTURED_OUTPUTS
    guided_json: Optional[Union[dict[str, Any], bool, str]] = Field(None, description=GUIDED["guided_json"])
    guided_regex: Optional[str] = Field(None, description=GUIDED["guided_regex"])
    guided_choice: Optional[list[str]] = Field(None, description=GUIDED["guided_choice"])
    guided_grammar: Optional[str] = Field(None, description=GUIDED["guided_grammar"])

    def structured(self, tokenizer: Any) -> Structured:
        """The request's constraint and tool plan; ApiError (400) naming the field at fault."""
        constraints = self._field_constraints()
        tools = self._tool_plan(tokenizer)
        if tools.constraint is not None:
            constraints.append((tools.param, tools.constraint))
        if len(constraints) > 1:
            names = [param for param, _ in constraints]
            raise ApiError(400, f"a request takes one constraint; got {' and '.join(repr(n) for n in names)}: "
                                "send only one of them", names[-1])
        if constraints:
            param, constraint = constraints[0]
            return Structured(constraint, param, tools.tools, tools.parsing)
        return tools

    def _field_constraints(self) -> list[tuple[str, Constraint]]:
        """Every constraint the request's fields give, with the field it came from."""
        found: list[tuple[str, Constraint]] = []
        fmt = self.response_format
        if isinstance(fmt, JsonObjectFormat):
            found.append(("response_format", Constraint.json_object()))
        elif isinstance(fmt, JsonSchemaFormat):
            found.append(("response_format", _constraint("response_format", Constraint.json_schema,
                                                         fmt.json_schema.schema_)))
        if self.structured_outputs is not None:
            found += _structured_outputs(self.structured_outputs)
        for name, make in (("guided_json", Constraint.json_schema), ("guided_regex", Constraint.regex),
                           ("guided_choice", Constraint.choice), ("guided_grammar", Constraint.grammar)):
            value = getattr(self, name)
            if value is not None:
                found.append((name, _constraint(name, make, value)))
        return found

    def _tool_plan(self, tokenizer: Any) -> Structured:
        return Structured()


class ToolFields(StructuredFields):
    """The chat route's tool fields."""

    tools: Optional[list[ToolDef]] = Field(
        None, description="a list of {type: 'function', function: {name, description, parameters}}: functions "
                          "the model may call (its chat template must take tools)")
    tool_choice: Optional[ToolChoice] = Field(
        None, description="'none', 'auto' (default with tools), 'required' or {type: 'function', function: {name}}")
    parallel_tool_calls: Optional[bool] = Field(True, description="a boolean: false allows at most one call")

    def _tool_plan(self, tokenizer: Any) -> Structured:
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice != "none":
                raise ApiError(400, f"'tool_choice' {_shown(choice)} needs 'tools': send the functions it may call",
                               "tool_choice")
            return Structured()
        functions = _functions(self.tools)
        try:
            fmt = tool_format(tokenizer)
        except ToolsUnsupported as err:
            raise ApiError(400, str(err), "tools") from None
        definitions = tuple(f.as_openai() for f in functions)
        choice = choice or "auto"
        if choice == "none":  # shown to the model (as OpenAI does), never parsed: no calls
            return Structured(tools=definitions)
        if choice == "auto":
            return Structured(tools=definitions, parsing=ToolParsing(fmt, None if self.parallel_tool_calls else 1))
        if choice == "required":
            chosen, parallel = functions, bool(self.parallel_tool_calls)
        else:
            chosen, parallel = [_named(functions, choice.function.name)], False
        try:
            grammar = fmt.call_grammar(chosen, parallel)
        except Exception as err:  # noqa: BLE001 - xgrammar's types vary; its message says what
            raise ApiError(400, f"'tools': a function's parameters cannot be made a grammar: {err}", "tools") from None
        return Structured(Constraint.grammar(grammar), "tool_choice" if choice != "required" else "tools",
                          definitions, ToolParsing(fmt, None if parallel else 1))


def _structured_outputs(given: StructuredOutputs) -> list[tuple[str, Constraint]]:
    """vLLM's structured_outputs: exactly one of its fields."""
    makers = {"json_": Constraint.json_schema, "regex": Constraint.regex, "choice": Constraint.choice,
              "grammar": Constraint.grammar}
    found = [(name, value) for name, value in given if value is not None and value is not False]
    if len(found) != 1:
        names = ", ".join(n.rstrip("_") for n, _ in found) or "none"
        raise ApiError(400, "'structured_outputs' takes exactly one of json, regex, choice, grammar, json_object; "
                            f"got {names}", "structured_outputs")
    name, value = found[0]
    if name == "json_object":
        return [("structured_outputs", Constraint.json_object())]
    return [("structured_outputs", _constraint(f"structured_outputs.{name.rstrip('_')}", makers[name], value))]


def _constraint(where: str, make, value) -> Constraint:
    """``make(value)``, its ConstraintError as a 400 naming the field (its first part)."""
    try:
        return make(value)
    except ConstraintError as err:
        raise ApiError(400, f"invalid '{where}': {err}", where.split(".")[0]) from None


def _functions(tools: list[ToolDef]) -> list[ToolFunction]:
    """The tools' functions, each parameters schema checked; names must differ."""
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise ApiError(400, f"'tools[{i}].function.name': {fn.name!r} is defined twice", "tools")
        seen.add(fn.name)
        if fn.parameters is not None:
            try:
                check_parameters(fn.parameters)
            except ValueError as err:
                raise ApiError(400, f"'tools[{i}].function.parameters' {err}", "tools") from None
        out.append(ToolFunction(fn.name, fn.description, fn.parameters))
    return out


def _named(functions: list[ToolFunction], name: str) -> ToolFunction:
    for f in functions:
        if f.name == name:
            return f
    raise ApiError(400, f"'tool_choice' names function {name!r}, which is not in 'tools' "
                        f"(functions: {', '.join(f.name for f in functions)})", "tool_choice")


def _shown(value: Any) -> str:
    return json.dumps(value.model_dump() if hasattr(value, "model_dump") else value)
