"""Structured-output workloads: the request fields a prompt-set entry may carry, the constraint
the offline bench gives it, and whether an answer matches what it asked for.

An entry (a JSONL line, or an item of a JSON list) may carry, besides its prompt, OpenAI's
``response_format``, vLLM's ``structured_outputs``, ``tools`` and ``tool_choice``, sent with its
request as they are; ``schema`` is a shorthand for ``response_format`` of type ``json_schema``.
They are checked here, when the set is read, so that a bad entry fails before any model loads.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Sequence

from trtssd.structured.constraint import Constraint

log = logging.getLogger(__name__)

STRUCTURED_FIELDS = ("response_format", "structured_outputs", "tools", "tool_choice")
SCHEMA_SHORTHAND = "schema"
RESPONSE_FORMATS = ("json_schema", "json_object", "text")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
TOOL_CHOICES = ("none", "auto", "required")
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Verdict:
    """Whether one answer matches its entry: valid None where there is nothing to check it against
    (a grammar, a text answer to tool_choice "auto")."""

    valid: bool | None
    reason: str = ""


@dataclass(frozen=True)
class Structured:
    """One entry's structured-output request fields, kept as compact JSON text so that the prompt
    item holding it stays hashable and picklable."""

    body_json: str

    @property
    def body(self) -> dict[str, Any]:
        """The fields as they go into the request body."""
        return json.loads(self.body_json)

    @property
    def tools(self) -> list[dict] | None:
        return self.body.get("tools")

    @property
    def tool_choice(self) -> str | dict:
        """The tool choice in force: the given one, else "auto" where there are tools."""
        return self.body.get("tool_choice") or "auto"

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_call(self) -> bool:
        """Whether the request's grammar forces a call: tool_choice "required" or a named function."""
        return self.calls_tools and self.tool_choice != "auto"

    def answer_rule(self) -> tuple[str, Any] | None:
        """What a text answer must match: ("schema", dict), ("regex", str), ("choice", list),
        ("grammar", str), or None where the answer's text is free."""
        body = self.body
        fmt = body.get("response_format") or {}
        if fmt.get("type") == "json_schema":
            return "schema", fmt["json_schema"]["schema"]
        if fmt.get("type") == "json_object":
            return "schema", ANY_OBJECT
        outputs = body.get("structured_outputs") or {}
        for key, value in outputs.items():
            if key == "json":
                return "schema", json.loads(value) if isinstance(value, str) else value
            if key == "json_object":
                return "schema", ANY_OBJECT
            return key, value
        return None

    def schema(self) -> dict | None:
        """The JSON schema a text answer must follow, or None."""
        rule = self.answer_rule()
        return rule[1] if rule is not None and rule[0] == "schema" else None

    def constraint(self, tool_grammar: str | None = None) -> Constraint | None:
        """The `Constraint` the offline bench gives the request; ``tool_grammar`` is the call
        grammar of the model's tool format where the entry forces a call."""
        if self.forces_call:
            if tool_grammar is None:
                raise ValueError("tool_choice forces a call, so the model's tool-call grammar is needed")
            return Constraint.grammar(tool_grammar)
        rule = self.answer_rule()
        if rule is None:
            return None
        kind, value = rule
        if kind == "schema":
            return Constraint.json_object() if value is ANY_OBJECT else Constraint.json_schema(value)
        return {"regex": Constraint.regex, "choice": Constraint.choice, "grammar": Constraint.grammar}[kind](value)

    def forced_functions(self) -> list[dict]:
        """The functions a forced call may be of (each ``{"name", "parameters", ...}``)."""
        functions = [t["function"] for t in self.tools or ()]
        choice = self.tool_choice
        if isinstance(choice, dict):
            return [f for f in functions if f["name"] == choice["function"]["name"]]
        return functions


# --- reading an entry ----------------------------------------------------------------------------


def parse_structured(rec: dict, where: str) -> Structured | None:
    """The entry's structured-output fields, checked; None when it has none. Errors name the field,
    the entry (``where``) and the allowed values."""
    body = {key: rec[key] for key in STRUCTURED_FIELDS if rec.get(key) is not None}
    if rec.get(SCHEMA_SHORTHAND) is not None:
        if "response_format" in body:
            raise ValueError(f"{where}: give 'schema' or 'response_format', not both")
        body["response_format"] = _schema_format(rec[SCHEMA_SHORTHAND], where)
    if not body:
        return None
    if "response_format" in body:
        _check_response_format(body["response_format"], where)
    if "structured_outputs" in body:
        _check_structured_outputs(body["structured_outputs"], where)
    if "tools" in body:
        _check_tools(body["tools"], where)
    if "tool_choice" in body:
        _check_tool_choice(body["tool_choice"], body.get("tools") or [], where)
    structured = Structured(json.dumps(body, separators=(",", ":")))
    _check_one_constraint(structured, body, where)
    return structured


def _schema_format(schema: Any, where: str) -> dict:
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: 'schema' must be a JSON schema object; got {type(schema).__name__}")
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _check_response_format(fmt: Any, where: str) -> None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"{where}: 'response_format' must be an object with type one of {', '.join(RESPONSE_FORMATS)}; "
                         f"got {fmt!r}")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise ValueError(f"{where}: 'response_format.json_schema.schema' must be a JSON schema object")


def _check_structured_outputs(outputs: Any, where: str) -> None:
    given = [k for k, v in outputs.items() if v is not None and v is not False] if isinstance(outputs, dict) else []
    if len(given) != 1 or given[0] not in STRUCTURED_OUTPUT_KEYS:
        raise ValueError(f"{where}: 'structured_outputs' must be an object with exactly one of "
                         f"{', '.join(STRUCTURED_OUTPUT_KEYS)}; got {outputs!r}")


def _check_tools(tools: Any, where: str) -> None:
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where}: 'tools' must be a non-empty list of {{type: 'function', function: {{name, parameters}}}}")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}: 'tools[{i}]' must be {{type: 'function', function: {{name, parameters}}}}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"{where}: 'tools[{i}].function.parameters' must be a JSON schema object")


def _check_tool_choice(choice: Any, tools: list, where: str) -> None:
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ValueError(f"{where}: 'tool_choice' names function {name!r}, not one of 'tools' ({', '.join(names)})")
        return
    if choice not in TOOL_CHOICES:
        raise ValueError(f"{where}: 'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                         f"{{type: 'function', function: {{name}}}}; got {choice!r}")
    if choice != "none" and not tools:
        raise ValueError(f"{where}: 'tool_choice' {choice!r} needs 'tools'")


def _check_one_constraint(structured: Structured, body: dict, where: str) -> None:
    """At most one constraint per request, as the server requires."""
    sources = [name for name in ("response_format", "structured_outputs") if name in body
               and not (name == "response_format" and body[name].get("type") == "text")]
    if structured.forces_call:
        sources.append("tool_choice")
    if len(sources) > 1:
        raise ValueError(f"{where}: one constraint per request; got {' and '.join(sources)}")


# --- judging an answer ---------------------------------------------------------------------------


def judge(structured: Structured | None, text: str, tool_calls: Sequence[dict]) -> Verdict:
    """Whether an answer (its text, and its calls as ``{"name", "arguments"}`` with arguments as
    JSON text) matches its entry: a call's arguments against its function's parameters, a text
    answer against the schema, regex or choice it was asked for."""
    if structured is None:
        return Verdict(None)
    if structured.calls_tools and (tool_calls or structured.forces_call):
        return _judge_calls(structured, tool_calls)
    rule = structured.answer_rule()
    if rule is None or rule[0] == "grammar":
        return Verdict(None)
    kind, value = rule
    if kind == "regex":
        return Verdict(True) if re.fullmatch(value, text) else Verdict(False, "does not match the regex")
    if kind == "choice":
        return Verdict(True) if text in value else Verdict(False, "not one of the choices")
    return _judge_json(text, value)


def _judge_calls(structured: Structured, tool_calls: Sequence[dict]) -> Verdict:
    if not tool_calls:
        return Verdict(False, "no tool call")
    functions = {f["name"]: f for f in structured.forced_functions()}
    for call in tool_calls:
        fn = functions.get(call.get("name"))
        if fn is None:
            return Verdict(False, f"call of {call.get('name')!r}, not one of {', '.join(functions)}")
        verdict = _judge_json(call.get("arguments") or "", fn.get("parameters") or ANY_OBJECT)
        if not verdict.valid:
            return Verdict(False, f"{fn['name']} arguments: {verdict.reason}")
    return Verdict(True)


def _judge_json(text: str, schema: dict) -> Verdict:
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return Verdict(False, f"not JSON ({err.msg} at {err.pos})")
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as err:
        return Verdict(False, f"schema: {err.message[:120]}")
    return Verdict(True)


def validity_counts(verdicts: Sequence[Verdict | None]) -> dict | None:
    """{"checked", "valid", "invalid_reasons"} over the answers with something to check, or None."""
    checked = [v for v in verdicts if v is not None and v.valid is not None]
    if not checked:
        return None
    reasons: dict[str, int] = {}
    for v in checked:
        if not v.valid:
            reasons[v.reason] = reasons.get(v.reason, 0) + 1
    return {"checked": len(checked), "valid": sum(1 for v in checked if v.valid), "invalid_reasons": reasons}
