"""Forward-pass timings of the models on this machine and the speedup model's predictions for each run."""

from __future__ import annotations

import gc
import logging
import platform
import time
from dataclasses import replace
from typing import Iterable

import numpy as np
import torch

from trtssd.backends.base import chain_chunk
from trtssd.backends.loading import load_executor
from trtssd.engines import resolve_models
from trtssd.bench.config import TRTSSD_SYSTEMS
from trtssd.bench.records import RunResult
from trtssd.config import ModelRef
from trtssd.runtime.calibration import middle_tree_step, scratch_sequences, time_forward, write_tree_before_middle
from trtssd.spec_decode.speedup import CostCurve, Timings, Workload, acceptance_from_length, predict_ar, predict_sd, predict_ssd
from trtssd.spec_decode.backup import ngram_proposal

log = logging.getLogger(__name__)


def _cost_curve(samples: dict[int, list[float]]) -> CostCurve:
    return CostCurve(tuple((n, float(np.mean(v))) for n, v in sorted(samples.items())))


def measure_timings(engine: str | None = None, target: str | None = None, draft: str | None = None,
                    batch_sizes: Iterable[int] = (1,), ks: Iterable[int] = (5,), budgets: Iterable[int] = (12,),
                    context: int = 128, repeats: int = 3, threads: int = 1) -> Timings:
    """Forward-pass costs of the engine's target and draft on this machine, with the shapes the
    runtime uses: 1-token steps, (K+1)-token verify/glue chains and tree steps of B branches per
    sequence, for each batch size, after a ``context``-token prefix. The handshake is not
    measured here (see compare_with_plan)."""
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
            with scratch_sequences(ex, max(batch_sizes), context) as seqs:
                curves[side] = _cost_curve(_chain_samples(ex, seqs, batch_sizes, ks, context, repeats))
                if side == "draft":
                    curves["tree"] = _cost_curve(_tree_samples(ex, seqs, batch_sizes, ks, budgets, context, repeats))
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


def _chain_samples(ex, seqs: list[int], batch_sizes, ks, context: int, repeats: int) -> dict[int, list[float]]:
    """Seconds of 1-token steps and (K+1)-token chains, by tokens in the pass."""
    samples: dict[int, list[float]] = {}
    for b in batch_sizes:
        for n in sorted({1} | {k + 1 for k in ks}):
            chunks = [chain_chunk(s, [1] * n, context) for s in seqs[:b]]
            samples.setdefault(b * n, []).append(time_forward(ex, chunks, repeats))
    return samples


def _tree_samples(ex, seqs: list[int], batch_sizes, ks, budgets, context: int, repeats: int) -> dict[int, list[float]]:
    """Seconds of a tree step of B branches per sequence, by tokens in the pass (the middle step,
    after the glue and the steps before it are written)."""
    samples: dict[int, list[float]] = {}
    for b in batch_sizes:
        for k in ks:
            for bud in budgets:
                for s in seqs[:b]:
                    write_tree_before_middle(ex, s, context, k, bud)
                chunks = [middle_tree_step(s, context, k, bud) for s in seqs[:b]]
                samples.setdefault(b * bud, []).append(time_forward(ex, chunks, repeats))
    return samples


def workload_from_summary(spec: dict, k: int) -> Workload:
    """a, h and the fast backup's acceptance as one run measured them (SpeculationMetrics.summary())."""
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

    Either difference can come out negative (the forwards timed in isolation after the runs were
    slower than inside them). The model cannot use a negative time: it uses 0, a warning says so,
    and every row records the measured value next to the one used, so an ar row then shows the
    calibration's own error instead of matching by construction.
    """
    # "auto" mixes plain and speculative rounds: no one model predicts it.
    ok = [r for r in runs if r.error is None and r.key.system in TRTSSD_SYSTEMS and r.key.system != "auto"]
    overhead = _overhead_by_batch(ok, timings)
    for b, value in sorted(overhead.items()):
        if value < 0:
            log.warning("batch %d: ar's decode step is %.2f ms shorter than the target forward timed after the runs; "
                        "the plan uses a host overhead of 0 (the ar row's error is the calibration's)", b, -value * 1e3)
    if handshake_s is None:
        measured_handshake = _handshake_from_sd(ok, timings)
        handshake_source = "sd runs"
        if measured_handshake is not None and measured_handshake < 0:
            log.warning("sd's draft wait per round is %.2f ms shorter than its K draft steps timed after the runs; "
                        "the plan uses a handshake of 0", -measured_handshake * 1e3)
        handshake_s = max(measured_handshake or 0.0, 0.0)
    else:
        measured_handshake = None
        handshake_source = "given"
    for run in ok:
        key = run.key
        measured_overhead = overhead.get(key.batch_size)
        t = replace(timings, overhead_s=max(measured_overhead or 0.0, 0.0), handshake_s=handshake_s)
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
        row = pred.to_dict()
        row.update(overhead_ms=round(t.overhead_s * 1e3, 4), overhead_measured_ms=_ms(measured_overhead),
                   handshake_ms=round(t.handshake_s * 1e3, 4), handshake_measured_ms=_ms(measured_handshake),
                   handshake_from=handshake_source, calibration_only=key.system == "ar",
                   measured_decode_tokens_per_s=measured,
                   error=round(pred.tokens_per_s / measured - 1, 4) if measured else None)
        run.prediction = row


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)


def _overhead_by_batch(runs: list[RunResult], timings: Timings) -> dict[int, float]:
    """Per batch size with an ar run: its mean decode step minus the measured target forward
    (negative when the forward timed slower in isolation than in the run)."""
    out = {}
    for b in sorted({r.key.batch_size for r in runs}):
        steps = [b / r.summary["decode_tokens_per_s"] for r in runs
                 if r.key.system == "ar" and r.key.batch_size == b and r.summary.get("decode_tokens_per_s")]
        if steps:
            out[b] = float(np.mean(steps)) - timings.target(b)
    return out


def _handshake_from_sd(runs: list[RunResult], timings: Timings) -> float | None:
    """Median over the sd runs of their draft wait per round minus K draft steps (None: no sd run)."""
    values = []
    for r in runs:
        if r.key.system != "sd" or not r.summary["spec"]["num_drafts"]:
            continue
        s = r.summary["spec"]
        wait = s["draft_wait_time_s"] / s["num_drafts"]
        values.append(wait - r.key.k * timings.draft(r.key.batch_size))
    return float(np.median(values)) if values else None
