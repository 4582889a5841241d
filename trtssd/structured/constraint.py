"""What a request's output must match: one `Constraint`, carried by `SamplingParams`.

A constraint is plain data (hashable, picklable: it travels to the draft rank with the request);
turning it into token masks is `trtssd.structured.grammar`'s work. Its form is checked here; its
content (a schema that is not a schema, a regex that does not parse) is checked when the grammar
engine compiles it, at admission (`Grammars.check`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class ConstraintError(ValueError):
    """A constraint that cannot be served; the message says what is wrong with it."""


@dataclass(frozen=True)
class Constraint:
    """The language a request's output must belong to.

    kind:  json_schema  value = the schema as compact JSON text (its key order kept: properties
                        are generated in the order the schema lists them)
           json_object  value = "" (any JSON object)
           regex        value = the regular expression (the whole output matches it)
           choice       value = the allowed outputs, a tuple of strings
           grammar      value = a context-free grammar in EBNF (GBNF-style, root rule ``root``)
    """

    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind == "choice":
            value = tuple(self.value) if isinstance(self.value, (list, tuple)) else self.value
            if not isinstance(value, tuple) or not value or not all(isinstance(c, str) and c for c in value):
                raise ConstraintError(f"a choice constraint needs a non-empty list of non-empty strings; got {self.value!r}")
            object.__setattr__(self, "value", value)
        elif not isinstance(self.value, str):
            raise ConstraintError(f"a {self.kind} constraint's value must be a string; got {type(self.value).__name__}")
        elif self.kind in ("regex", "grammar", "json_schema") and not self.value.strip():
            raise ConstraintError(f"a {self.kind} constraint needs a non-empty value")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool) -> "Constraint":
        """A JSON schema given as a dict or JSON text; its JSON must parse and be an object
        (or true: any JSON value)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ConstraintError(f"the JSON schema is not valid JSON: {err}") from None
        if not isinstance(schema, dict) and schema is not True:
            raise ConstraintError(f"a JSON schema must be a JSON object; got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Iterable[str]) -> "Constraint":
        return cls("choice", tuple(options))

    @classmethod
    def grammar(cls, ebnf: str) -> "Constraint":
        return cls("grammar", ebnf)

    @property
    def schema(self) -> Any:
        """The JSON schema of a json_schema constraint, parsed."""
        return json.loads(self.value) if self.kind == "json_schema" else None

    def __str__(self) -> str:
        shown = self.value if isinstance(self.value, str) else json.dumps(list(self.value))
        return f"{self.kind}({shown[:80]}{'...' if len(shown) > 80 else ''})"
