"""Command-line options made from the config dataclasses: one option per field of
SpeculativeConfig and RuntimeConfig (trtssd/config.py), named after the field (``max_model_len`` ->
``--max-model-len``), typed by it and helped by its ``help`` metadata. Every command that starts an
engine declares them through `add_engine_options` and reads them back with `engine_options`, so a
new field reaches all of them at once and no two can drift apart.

The output constraint options (``--json-schema``, ``--json-object``, ``--regex``, ``--choice``,
``--grammar``: one at most) are declared by `add_constraint_options` and read by `cli_constraint`."""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import enum
import functools
import types
import typing
from typing import Any, Callable

from trtssd.config import (RENAMED_OPTIONS, RENAMED_VALUES, RuntimeConfig, SpeculativeConfig, renamed_options,
                           speculative_config)
from trtssd.structured.constraint import Constraint, ConstraintError

# Each config's options in a group of their own, titled for `--help`.
ENGINE_CONFIGS = {
    SpeculativeConfig: "speculation (unset: the engine's tuned value, else the default shown)",
    RuntimeConfig: "process layout and capacity",
}
ENGINE_FIELDS = tuple(f.name for cls in ENGINE_CONFIGS for f in dataclasses.fields(cls))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One option per config field, except those in ``skip`` (a command that sets them itself).
    Every default is None, so `engine_options` can tell what was given from what was not."""
    for cls, title in ENGINE_CONFIGS.items():
        group = parser.add_argument_group(title)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in skip:
                group.add_argument(flag(f.name), dest=f.name, default=None, help=_help(f), **_kind(f, hints[f.name]))
        for old, new in RENAMED_OPTIONS.items():
            if new in cls.__dataclass_fields__ and new not in skip:
                kind = _kind(cls.__dataclass_fields__[new], hints[new])
                if kind.get("choices") and old in RENAMED_VALUES:  # the old words too
                    kind["choices"] = [*kind["choices"], *RENAMED_VALUES[old]]
                group.add_argument(flag(old), dest=old, default=None, help=f"deprecated: use {flag(new)}", **kind)
    # Which they are, for engine_options: a skipped name may be the command's own option (bench's --k).
    parser.set_defaults(engine_fields=tuple(name for name in ENGINE_FIELDS if name not in skip))


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """Which models run: an engine directory, or model files."""
    parser.add_argument("--engine", default=None, help="engine directory (default: the embedded SmolLM2 engine)")
    parser.add_argument("--target", default=None, help="instead of --engine: the target model, a Hugging Face "
                        "directory or .gguf file")
    parser.add_argument("--draft", default=None, help="with --target: the draft model (default: the target itself)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given, as keywords of trtssd.LLM (those not given keep LLM's defaults),
    checked as LLM will check them, so that a bad value is said before anything loads and names
    its option."""
    given = {name: getattr(args, name) for name in args.engine_fields if getattr(args, name) is not None}
    renamed = {old: getattr(args, old) for old in RENAMED_OPTIONS if getattr(args, old, None) is not None}
    try:
        given = renamed_options({**given, **renamed})
        spec = {name: value for name, value in given.items() if name in SpeculativeConfig.__dataclass_fields__}
        speculative_config(spec)
        RuntimeConfig(**{name: value for name, value in given.items() if name not in spec})
    except ValueError as err:
        # The configs' messages start with the field they are about.
        name = str(err).split(" ", 1)[0]
        raise ValueError(f"argument {flag(name)}: {err}" if name in ENGINE_FIELDS else str(err)) from None
    return given


def _help(f: dataclasses.Field) -> str:
    default = f.default.value if isinstance(f.default, enum.Enum) else f.default
    if isinstance(default, bool):
        default = "on" if default else "off"
    shown = "" if default is None else f" (default: {default})"
    return (f.metadata["help"] + shown).replace("%", "%%")  # argparse formats help with %


def _kind(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """How argparse takes a field's value: its add_argument keywords."""
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}  # --plain-under-load / --no-plain-under-load
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"choices": [member.value for member in hint]}
    if hint in (int, float):
        return {"type": hint}
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if set(members) in ({int, type(None)}, {float, type(None)}):  # unset means None: the default's own rule
        return {"type": next(m for m in members if m is not type(None))}
    if any(_is_int_sequence(m) for m in members):
        # Comma-separated ints; a field that is also a string (fanout) takes its default word too.
        return {"type": _int_list(f.default if str in members else None)}
    return {"choices": f.metadata.get("choices")}


def _is_int_sequence(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    return origin in (tuple, collections.abc.Sequence) and typing.get_args(hint)[0] is int


@functools.cache  # one parser per word: every command's option takes the very same one
def _int_list(word: str | None) -> Callable[[str], str | tuple[int, ...]]:
    def parse(text: str) -> str | tuple[int, ...]:
        if text == word:
            return text
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            expected = f"{word!r} or comma-separated integers" if word else "comma-separated integers"
            raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}") from None
    return parse


def add_constraint_options(parser: argparse.ArgumentParser) -> None:
    """The options that constrain the output (trtssd.Constraint); at most one of them."""
    group = parser.add_argument_group("output constraint (one at most)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                       help="the output is JSON following this schema (a file, or the schema's JSON text)")
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", default=None, help="the output matches this regular expression")
    group.add_argument("--choice", action="append", default=None, help="the output is one of these strings "
                       "(repeat: --choice yes --choice no)")
    group.add_argument("--grammar", default=None, metavar="FILE",
                       help="the output follows this EBNF grammar file (xgrammar's dialect, root rule 'root')")


def cli_constraint(args: argparse.Namespace) -> tuple[Constraint | None, str | None]:
    """The constraint the options ask for and the option it came from; ValueError naming the
    option when its value is not one (the grammar engine's own check comes at admission)."""
    try:
        if args.json_schema is not None:
            return Constraint.json_schema(_file_or_text(args.json_schema, "--json-schema")), "--json-schema"
        if args.json_object:
            return Constraint.json_object(), "--json-object"
        if args.regex is not None:
            return Constraint.regex(args.regex), "--regex"
        if args.choice is not None:
            return Constraint.choice(args.choice), "--choice"
        if args.grammar is not None:
            return Constraint.grammar(_read(args.grammar, "--grammar")), "--grammar"
    except ConstraintError as err:
        flag_name = next(f for f in ("--json-schema", "--regex", "--choice", "--grammar")
                         if getattr(args, f[2:].replace("-", "_")) is not None)
        raise ValueError(f"argument {flag_name}: {err}") from None
    return None, None


def _file_or_text(value: str, flag_name: str) -> str:
    """A file's text when ``value`` names one, else ``value`` itself (inline JSON)."""
    stripped = value.lstrip()
    if stripped.startswith("{") or stripped in ("true", "false"):
        return value
    return _read(value, flag_name)


def _read(path: str, flag_name: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"argument {flag_name}: cannot read {path!r}: {err.strerror}") from None
