"""`trtssd generate`'s constraint options: one at most, each value checked with the option named
(before anything loads, or by the grammar engine at admission), and a constrained run on the
SmolLM2 ggml engine in ar mode."""

from __future__ import annotations

import json
import re

import pytest

from trtssd import cli
from trtssd.structured.constraint import Constraint

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _constraint(argv: list[str]):
    return cli.cli_constraint(cli.build_parser().parse_args(["generate", *argv]))


def test_each_option_gives_its_constraint(tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    grammar_file = tmp_path / "g.ebnf"
    grammar_file.write_text('root ::= "a" | "b"')
    assert _constraint([]) == (None, None)
    assert _constraint(["--json-schema", str(schema_file)]) == (Constraint.json_schema(SCHEMA), "--json-schema")
    assert _constraint(["--json-schema", json.dumps(SCHEMA)])[0] == Constraint.json_schema(SCHEMA)
    assert _constraint(["--json-object"]) == (Constraint.json_object(), "--json-object")
    assert _constraint(["--regex", "[0-9]+"]) == (Constraint.regex("[0-9]+"), "--regex")
    assert _constraint(["--choice", "yes", "--choice", "no"]) == (Constraint.choice(["yes", "no"]), "--choice")
    assert _constraint(["--grammar", str(grammar_file)]) == (Constraint.grammar('root ::= "a" | "b"'), "--grammar")


@pytest.mark.parametrize("argv, match", [
    (["--regex", "a", "--choice", "a"], "argument --choice: not allowed with argument --regex"),
    (["--json-object", "--grammar", "g"], "not allowed with argument"),
    (["--json-schema", "/no/such/file.json"], "argument --json-schema: cannot read '/no/such/file.json'"),
    (["--json-schema", '{"type": '], "argument --json-schema: the JSON schema is not valid JSON"),
    (["--json-schema", "[1]"], "argument --json-schema: cannot read"),
    (["--regex", ""], "argument --regex: a regex constraint needs a non-empty value"),
    (["--choice", ""], "argument --choice: a choice constraint needs a non-empty list"),
])
def test_bad_values_are_usage_errors_naming_the_option(capsys, argv, match):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--engine", "/nonexistent", *argv])
    assert exit_info.value.code == 2
    assert re.search(re.escape(match), capsys.readouterr().err)


@pytest.mark.slow
def test_a_constrained_run_and_an_invalid_regex(capsys):
    from trtssd.build import build_engine

    engine = str(build_engine("smollm2-135m", backend="ggml", progress=False))
    assert cli.main(["generate", "--engine", engine, "--mode", "ar", "--prompt", "Is the sky blue? Answer:",
                     "--choice", "yes", "--choice", "no", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["outputs"][0]["text"] in ("yes", "no") and out["outputs"][0]["finish_reason"] == "stop"
    with pytest.raises(SystemExit):
        cli.main(["generate", "--engine", engine, "--mode", "ar", "--prompt", "x", "--regex", "[0-9"])
    assert "argument --regex: invalid regex" in capsys.readouterr().err
