"""The offline bench's structured-output sets: each prompt's `Constraint` (so ar, sd and ssd decode
under the same grammar), and each answer judged against its schema after the run."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Sequence

from trtssd.bench.prompts import PromptItem
from trtssd.bench.records import RunResult
from trtssd.bench.workload import Structured, Verdict, judge, validity_counts
from trtssd.structured.constraint import Constraint
from trtssd.structured.tools import HermesFormat, ToolFunction, ToolsUnsupported, parse_tool_calls, tool_format

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StructuredSet:
    """One prompt set's constraints, in prompt order, and what each prompt asked for, by prompt id."""

    constraints: tuple[Constraint | None, ...]
    fields: dict[str, Structured | None]
    tool_format: HermesFormat | None  # the model's call format, where the set has tool calls


def structured_sets(items: dict[str, list[PromptItem]], tokenizer: Any
                    ) -> tuple[dict[str, list[PromptItem]], dict[str, StructuredSet], list[str]]:
    """(the sets, less tool-call entries the model cannot take; a StructuredSet per set with
    structured entries; notes for the report)."""
    kept: dict[str, list[PromptItem]] = {}
    sets: dict[str, StructuredSet] = {}
    notes: list[str] = []
    for ds, its in items.items():
        if not any(it.structured is not None for it in its):
            kept[ds] = its
            continue
        fmt, its = _tool_entries(ds, its, tokenizer, notes)
        kept[ds] = its
        sets[ds] = StructuredSet(tuple(_constraint(it, fmt) for it in its), {it.id: it.structured for it in its}, fmt)
        notes.append(f"{ds}: {sum(c is not None for c in sets[ds].constraints)} of {len(its)} prompts constrained "
                     "(SamplingParams.constraint; run without ignore_eos: a constrained answer ends where its "
                     "grammar does)")
    return kept, sets, notes


def _tool_entries(ds: str, its: list[PromptItem], tokenizer: Any,
                  notes: list[str]) -> tuple[HermesFormat | None, list[PromptItem]]:
    """The model's tool-call format, and the set without its tool entries where the model has none."""
    with_tools = [it for it in its if it.structured is not None and it.structured.tools]
    if not with_tools:
        return None, its
    try:
        return tool_format(tokenizer), its
    except ToolsUnsupported as err:
        notes.append(f"{ds}: {len(with_tools)} tool-call prompts left out ({err})")
        log.warning("%s: %d tool-call prompts left out: %s", ds, len(with_tools), err)
        return None, [it for it in its if it not in with_tools]


def _constraint(item: PromptItem, fmt: HermesFormat | None) -> Constraint | None:
    """The prompt's constraint; a forced tool call is the model's call grammar over the functions
    it may call (one call for a named function, one or more for "required", as the server does)."""
    fields = item.structured
    if fields is None:
        return None
    grammar = None
    if fields.forces_call and fmt is not None:
        functions = [ToolFunction(f["name"], f.get("description"), f.get("parameters"))
                     for f in fields.forced_functions()]
        grammar = fmt.call_grammar(functions, parallel=fields.tool_choice == "required")
    return fields.constraint(grammar)


def judge_run(run: RunResult, sset: StructuredSet | None, tokenizer: Any) -> RunResult:
    """The run with each answer's validity recorded, and the counts in its summary."""
    if sset is None or run.error is not None:
        return run
    verdicts: list[Verdict] = []
    judged = []
    for record in run.requests:
        verdict = judge_answer(sset.fields.get(record.prompt_id), record.output_ids, tokenizer, sset.tool_format)
        verdicts.append(verdict)
        judged.append(replace(record, valid=verdict.valid, invalid_reason=verdict.reason or None))
    run.requests = judged
    counts = validity_counts(verdicts)
    if counts is not None:
        run.summary["structured"] = counts
    return run


def judge_answer(fields: Structured | None, output_ids: Sequence[int], tokenizer: Any,
                 fmt: HermesFormat | None) -> Verdict:
    """One answer's tokens, decoded (tool calls parsed out where its entry has tools), judged."""
    if fields is None:
        return Verdict(None)
    text = tokenizer.decode(list(output_ids), skip_special_tokens=True)
    calls: list[dict] = []
    if fields.calls_tools and fmt is not None:
        parsed = parse_tool_calls(text, fmt)
        text = parsed.content or ""
        calls = [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]
    return judge(fields, text, calls)
