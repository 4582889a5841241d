"""Forward-pass timings of the models on this machine and the speedup model's predictions for each run."""

from __future__ import annotations

import gc
import logging
import platform
import time
from dataclasses import replace
from typing import Iterable

import numpy as np

from trtssd.bench.config import TRTSSD_SYSTEMS
from trtssd.bench.records import RunResult
from trtssd.plan import (
    CostCurve,
    Timings,
    Workload,
    acceptance_from_length,
    predict_ar,
    predict_sd,
    predict_ssd,
    prediction_row,
)

log = logging.getLogger(__name__)


def _time_forward(executor, chunks, repeats: int) -> float:
    """Median seconds of one forward (region slots are overwritten each time: repeatable)."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        executor.forward(chunks)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))  # the first call warms caches


def _cost_curve(samples: dict[int, list[float]]) -> CostCurve:
    return CostCurve(tuple((n, float(np.mean(v))) for n, v in sorted(samples.items())))


def measure_timings(engine: str | None = None, target: str | None = None, draft: str | None = None,
                    batch_sizes: Iterable[int] = (1,), ks: Iterable[int] = (5,), budgets: Iterable[int] = (12,),
                    context: int = 128, repeats: int = 3, threads: int = 1) -> Timings:
    """Forward-pass costs of the engine's target and draft on this machine, with the shapes the
    runtime uses: 1-token steps, (K+1)-token verify/glue chains and tree steps of B branches per
    sequence, for each batch size, after a ``context``-token prefix. The handshake is not
    measured here (see compare_with_plan)."""
    import torch

    from trtssd.backends.base import chain_chunk
    from trtssd.backends.loading import load_executor, resolve_models
    from trtssd.config import ModelRef
    from trtssd.spec_decode.backup import ngram_proposal
    from trtssd.spec_decode.tree import TreeLayout

    batch_sizes, ks, budgets = sorted(set(batch_sizes)), sorted(set(ks)), sorted(set(budgets))
    refs = resolve_models(engine, ModelRef(target) if target else None, ModelRef(draft) if draft else None)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        region = max(ks) + 1 + max(ks) * max(budgets)
        curves = {}
        for side, ref in zip(("target", "draft"), refs):
            # max_seq_len also bounds the tokens of one forward (the executor's max_batch_tokens).
            widest = max(batch_sizes) * max(max(ks) + 1, max(budgets))
            ex = load_executor(ref, max_seqs=max(batch_sizes), max_seq_len=max(context + region + 8, widest))
            seqs = _prefill_dummy(ex, max(batch_sizes), context, chain_chunk)
            chain: dict[int, list[float]] = {}
            for b in batch_sizes:
                for n in sorted({1} | {k + 1 for k in ks}):
                    chunks = [chain_chunk(s, [1] * n, context) for s in seqs[:b]]
                    chain.setdefault(b * n, []).append(_time_forward(ex, chunks, repeats))
            curves[side] = _cost_curve(chain)
            if side == "draft":
                tree: dict[int, list[float]] = {}
                for b in batch_sizes:
                    for k in ks:
                        for bud in budgets:
                            lay = [TreeLayout(s, context, k, torch.arange(bud) % (k + 1), torch.ones(bud, dtype=torch.long))
                                   for s in seqs[:b]]
                            step = (k - 1) // 2  # a middle step: its mask is of average width
                            chunks = [l.step_chunk(step, torch.ones(bud, dtype=torch.long)) for l in lay]
                            tree.setdefault(b * bud, []).append(_time_forward(ex, chunks, repeats))
                curves["tree"] = _cost_curve(tree)
            del ex
            gc.collect()
        history = list(range(context)) * 4
        t0 = time.perf_counter()
        for _ in range(10):
            ngram_proposal(history, max(ks))
        fast_s = (time.perf_counter() - t0) / 10
    finally:
        torch.set_num_threads(old_threads)
    where = engine or target or "default engine"
    return Timings(curves["target"], curves["draft"], curves["tree"], fast_backup_s=fast_s,
                   name=f"measured on {platform.node()} ({where}, {threads} thread(s))")


def _prefill_dummy(executor, n: int, context: int, chain_chunk) -> list[int]:
    seqs = list(range(n))
    for s in seqs:
        executor.add_sequence(s)
    vocab = min(executor.vocab_size, 1000)
    for s in seqs:
        executor.forward([chain_chunk(s, [(7 * i + s) % vocab for i in range(context)], 0, last_logits_only=True)])
        executor.commit(s, context)
    return seqs


def workload_from_summary(spec: dict, k: int) -> Workload:
    """a, h and the fast backup's acceptance as one run measured them (SpecMetrics.summary())."""
    hits, misses = spec["cache_hits"], spec["cache_misses"]
    h = hits / (hits + misses) if hits + misses else 0.0
    to_a = lambda accepted, rounds: acceptance_from_length(min(1 + accepted / rounds, k + 1), k)  # noqa: E731
    if not spec["num_drafts"]:
        return Workload(0.0, hit_rate=h)
    if spec["fast_backups"] == 0:  # every round verified a draft-model speculation
        return Workload(to_a(spec["num_accepted_tokens"], spec["num_drafts"]), hit_rate=h)
    # Fast-backup misses accept little: a comes from the hits, the fast acceptance from the misses
    # (which also hold any neural misses of an "auto" run; their average stands for both).
    fast_a = to_a(spec["accepted_on_miss"], misses)
    a = to_a(spec["accepted_on_hit"], hits) if hits else fast_a
    return Workload(a, hit_rate=h, fast_acceptance=fast_a)


def compare_with_plan(runs: list[RunResult], timings: Timings, handshake_s: float | None = None) -> None:
    """Attach the plan's predicted decode tokens/s to every trtssd run.

    Two inputs come from the runs themselves, and are labelled so: the target's per-step host
    overhead (the ar run's mean decode step minus the measured forward, per batch size), so ar's
    prediction is a calibration rather than a test; and, unless given, the handshake (the sd
    run's draft wait per round minus its K measured draft steps). a and h are the run's own.
    """
    ok = [r for r in runs if r.error is None and r.key.system in TRTSSD_SYSTEMS]
    overhead = _overhead_by_batch(ok, timings)
    if handshake_s is None:
        handshake_s = _handshake_from_sd(ok, timings)
        handshake_source = "sd runs"
    else:
        handshake_source = "given"
    for run in ok:
        key = run.key
        t = replace(timings, overhead_s=overhead.get(key.batch_size, 0.0), handshake_s=handshake_s)
        if key.system == "ar":
            pred = predict_ar(t, key.batch_size)
        else:
            w = workload_from_summary(run.summary["spec"], key.k)
            if key.system == "sd":
                pred = predict_sd(t, w, key.k, key.batch_size)
            else:
                s = run.summary["spec"]
                options = [b for b, n in (("neural", s["neural_backups"]), ("fast", s["fast_backups"])) if n]
                # The auto fan-out picks its width each round: predict with the mean it used.
                budget = max(round(s.get("mean_tree_branches") or key.budget), 1)
                preds = [predict_ssd(t, w, key.k, budget, key.batch_size, b) for b in options or ["neural"]]
                pred = max(preds, key=lambda p: p.tokens_per_s)
        measured = run.summary.get("decode_tokens_per_s")
        row = prediction_row(pred)
        row.update(overhead_ms=round(t.overhead_s * 1e3, 4), handshake_ms=round(t.handshake_s * 1e3, 4),
                   handshake_from=handshake_source, calibration_only=key.system == "ar",
                   measured_decode_tokens_per_s=measured,
                   error=round(pred.tokens_per_s / measured - 1, 4) if measured else None)
        run.prediction = row


def _overhead_by_batch(runs: list[RunResult], timings: Timings) -> dict[int, float]:
    """Per batch size: the ar run's mean decode step minus the measured target forward."""
    out = {}
    for b in sorted({r.key.batch_size for r in runs}):
        steps = [b / r.summary["decode_tokens_per_s"] for r in runs
                 if r.key.system == "ar" and r.key.batch_size == b and r.summary.get("decode_tokens_per_s")]
        if steps:
            out[b] = max(float(np.mean(steps)) - timings.target_step(b), 0.0)
    return out


def _handshake_from_sd(runs: list[RunResult], timings: Timings) -> float:
    values = []
    for r in runs:
        if r.key.system != "sd" or not r.summary["spec"]["num_drafts"]:
            continue
        s = r.summary["spec"]
        wait = s["draft_wait_time_s"] / s["num_drafts"]
        values.append(max(wait - r.key.k * timings.draft_step(r.key.batch_size), 0.0))
    return float(np.median(values)) if values else 0.0
