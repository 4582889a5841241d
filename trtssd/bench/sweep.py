"""The sweep: every configured cell run by its runner, then calibration and the plan comparison."""

from __future__ import annotations

import gc
import logging
import os
import shlex
import sys
from dataclasses import replace
from typing import Callable, Sequence

from trtssd.bench.calibration import compare_with_plan, measure_timings
from trtssd.bench.config import TRTSSD_SYSTEMS, BenchConfig, Instance, plan_instances
from trtssd.bench.prompts import encode_prompts, load_prompt_set
from trtssd.bench.records import BatchRecord, RunKey, RunResult, summarize
from trtssd.bench.report import (
    BenchReport,
    attach_comparisons,
    config_dict,
    machine_info,
)
from trtssd.bench.runners import HFRunner, LlamaCppRunner, SkipRun, TrtssdRunner
from trtssd.bench.structured_runs import StructuredSet, judge_run, structured_sets
from trtssd.models.tokenizer import load_tokenizer
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.spec_decode.speedup import Timings

log = logging.getLogger(__name__)


def _make_runner(inst: Instance, cfg: BenchConfig, max_seq_len: int):
    if inst.system in TRTSSD_SYSTEMS:
        return TrtssdRunner(cfg, inst.system, inst.k, inst.budget, max_seq_len)
    if inst.system == "hf":
        return HFRunner(cfg, needs_assistant=any(k.system == "hf-assisted" for k in inst.keys))
    return LlamaCppRunner(cfg, inst.system, inst.k, max_seq_len)


def _warmup(runner, key: RunKey, prompt: list[int], cfg: BenchConfig) -> None:
    short = replace(cfg, max_tokens=min(8, cfg.max_tokens))
    try:
        runner.run_batch(replace(key, batch_size=1), [prompt], ["warmup"], short, cfg.seed)
    except SkipRun:
        pass


def run_cell(runner, key: RunKey, prompts: Sequence[list[int]], ids: Sequence[str], cfg: BenchConfig,
             progress=None, constraints: Sequence = ()) -> RunResult:
    """Every prompt of one dataset, in static batches of key.batch_size; ``constraints`` (one per
    prompt, or empty) constrain the prompts of a structured-output set."""
    batches: list[BatchRecord] = []
    spec: SpeculationMetrics | None = None
    b = key.batch_size
    try:
        for start in range(0, len(prompts), b):
            extra = {"constraints": constraints[start:start + b]} if constraints else {}
            batch, metrics = runner.run_batch(key, prompts[start:start + b], ids[start:start + b], cfg,
                                              cfg.seed + start, **extra)
            batches.append(batch)
            if metrics is not None:
                spec = spec or SpeculationMetrics()
                spec.merge(metrics)
            if progress is not None:
                progress.update(1)
    except SkipRun as why:
        if progress is not None:
            progress.update(-(-len(prompts) // b) - len(batches))
        return RunResult(key, error=f"skipped: {why}")
    return RunResult(key, summarize(batches, spec), [r for bt in batches for r in bt.requests])


def run_benchmark(cfg: BenchConfig, command: str | None = None,
                  on_update: Callable[[BenchReport], None] | None = None) -> "BenchReport":
    """Run the sweep, calibrate, compare with the plan; returns the report.

    ``on_update`` (e.g. writing the report) is called with the report so far after each system
    and after the calibration, so a late failure loses none of the runs before it.
    """
    from tqdm import tqdm

    cfg = cfg.resolved()
    target_ref, _ = cfg.model_refs()
    tokenizer = load_tokenizer(target_ref.path)
    items = {ds: load_prompt_set(ds, cfg.prompts_per_set) for ds in cfg.datasets}
    items = {_dataset_name(ds, its): its for ds, its in items.items()}
    items, structured, structured_notes = structured_sets(items, tokenizer)
    items = {ds: its for ds, its in items.items() if its}  # a set of tool calls only may be left empty
    encoded = {ds: encode_prompts(its, tokenizer) for ds, its in items.items()}
    ids = {ds: [it.id for it in its] for ds, its in items.items()}
    longest = max(len(p) for ps in encoded.values() for p in ps)
    max_seq_len = _round_up(longest + cfg.max_tokens + 8, 64)
    instances = plan_instances(replace(cfg, datasets=tuple(items)))
    total = sum(-(-len(encoded[k.dataset]) // k.batch_size) for inst in instances for k in inst.keys)
    report = BenchReport(machine_info(), command or shlex.join(sys.argv), config_dict(cfg), [], None,
                         _start_notes(cfg, encoded) + structured_notes)
    update = on_update or (lambda _report: None)
    with tqdm(total=total, desc="bench", unit="batch", file=sys.stderr) as progress:
        for inst in instances:
            progress.set_postfix_str(inst.system + (f" K={inst.k}" if inst.k else "") +
                                     (f" B={inst.budget}" if inst.budget else ""))
            runs = _run_instance(inst, cfg, encoded, ids, max_seq_len, progress, report.notes, structured)
            report.runs += [judge_run(run, structured.get(run.key.dataset), tokenizer) for run in runs]
            attach_comparisons(report.runs)
            update(report)
    if cfg.calibrate and any(r.key.system in TRTSSD_SYSTEMS and r.error is None for r in report.runs):
        report.timings = _calibrate(cfg, report)
        update(report)
    report.machine = machine_info()  # the load average at the end
    return report


def _start_notes(cfg: BenchConfig, encoded: dict[str, list[list[int]]]) -> list[str]:
    """The report's notes known before any run: prompt sets, load, how the ranks sit on the cores."""
    notes = ["prompt sets: " + ", ".join(f"{ds} ({len(p)} prompts)" for ds, p in encoded.items())]
    if hasattr(os, "getloadavg"):
        notes.append(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    notes.append("trtssd ranks: " + ("each on every core, shared (--shared-cores)" if cfg.shared_cores
                                      else "one core each (target and draft pinned apart)")
                 + f"; plain rounds borrow the draft's cores: {cfg.lend_draft_cores}")
    return notes


def _calibrate(cfg: BenchConfig, report: BenchReport) -> Timings | None:
    """Time the forwards after the runs and attach the plan's predictions to the report's runs.
    A failure here is recorded in the notes and logged, and the runs are kept."""
    # The auto fan-out may pick any width up to the budget: time narrow trees too.
    widths = sorted({w for b in cfg.budgets for w in (1, 2, 4, b) if w <= b})
    try:
        timings = measure_timings(cfg.engine, cfg.target, cfg.draft, cfg.batch_sizes, cfg.ks, widths)
        compare_with_plan(report.runs, timings, cfg.handshake_s)
    except Exception as err:  # noqa: BLE001 - the runs are measured already; the plan is an extra
        log.exception("forward timing failed; the runs are reported without the plan comparison")
        report.notes.append(f"forward timing failed ({type(err).__name__}: {err}): no plan comparison")
        return None
    return timings


def _dataset_name(spec: str, items) -> str:
    return items[0].dataset if items else spec


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _run_instance(inst: Instance, cfg: BenchConfig, encoded, ids, max_seq_len: int, progress,
                  notes: list[str], structured: dict[str, StructuredSet] | None = None) -> list[RunResult]:
    batches = lambda key: -(-len(encoded[key.dataset]) // key.batch_size)  # noqa: E731
    try:
        runner = _make_runner(inst, cfg, max_seq_len)
    except SkipRun as why:
        progress.update(sum(batches(k) for k in inst.keys))
        return [RunResult(k, error=f"skipped: {why}") for k in inst.keys]
    except Exception as err:  # noqa: BLE001 - a system that cannot load is recorded, not fatal
        log.exception("could not start %s", inst.system)
        progress.update(sum(batches(k) for k in inst.keys))
        return [RunResult(k, error=f"failed to start: {type(err).__name__}: {err}") for k in inst.keys]
    results = []
    try:
        if getattr(runner, "assistant_note", ""):
            notes.append(f"hf-assisted: {runner.assistant_note}")
        if getattr(runner, "peer_note", "") and runner.peer_note not in notes:
            notes.append(runner.peer_note)
        if cfg.warmup:
            for first in {k.system: k for k in reversed(inst.keys)}.values():  # each system's first cell
                _warmup(runner, first, encoded[first.dataset][0], cfg)
        for key in inst.keys:
            try:
                constraints = structured[key.dataset].constraints if structured and key.dataset in structured else ()
                results.append(run_cell(runner, key, encoded[key.dataset], ids[key.dataset], cfg, progress,
                                        constraints))
            except Exception as err:  # noqa: BLE001
                log.exception("run %s failed", key)
                results.append(RunResult(key, error=f"failed: {type(err).__name__}: {err}"))
    finally:
        runner.close()
        del runner
        gc.collect()
    return results
