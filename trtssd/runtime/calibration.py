"""Calibration: timed forwards of an executor, stored per machine and model.

The draft times its chain forwards and tree steps at start-up (`DraftWorker.calibrate`), the
target its forwards before the loop starts (`round_policy.calibrate_target`): the shapes of the
speedup model's cost curves (trtssd/spec_decode/speedup.py). Forwards run on scratch sequences
of negative ids, in region slots only, so every timed call does the same work.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from trtssd.backends.base import Chunk, Executor, chain_chunk
from trtssd.spec_decode.speedup import check_int
from trtssd.spec_decode.tree import TreeLayout

log = logging.getLogger(__name__)


def time_forward(executor: Executor, chunks: Sequence[Chunk], repeats: int = 3) -> float:
    """Median seconds of one forward of ``chunks`` over ``repeats`` calls after a warm-up call
    (which fills caches). The chunks write region slots only, so every call does the same work."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats!r}")
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        executor.forward(chunks)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


@contextmanager
def scratch_sequences(executor: Executor, count: int, context: int) -> Iterator[list[int]]:
    """``count`` sequences with ``context`` committed tokens to time forwards on, released on exit.
    Their ids are negative: never a request's (the target numbers requests from 0)."""
    ids = [-1 - i for i in range(count)]
    vocab = min(executor.vocab_size, 1000)
    added = []
    try:
        for sid in ids:
            executor.add_sequence(sid)
            added.append(sid)
            prompt = [(7 * i - sid) % vocab for i in range(context)]  # varied tokens, like text
            executor.forward([chain_chunk(sid, prompt, 0, last_logits_only=True)])
            executor.commit(sid, context)
        yield ids
    finally:
        for sid in added:
            executor.release(sid)


def time_forwards(executor: Executor, max_rows: int = 64, context: int = 128, repeats: int = 3) -> dict[int, float]:
    """{rows: seconds} of chain forwards of 1, 2, 4, ... rows (up to ``max_rows`` and what the
    executor holds) after a ``context``-token prefix: the shape of a `StepCostModel`."""
    context, sizes = _timing_sizes(executor, max_rows, context, lambda rows: rows)
    with scratch_sequences(executor, 1, context) as (sid,):
        return {rows: time_forward(executor, [chain_chunk(sid, [1] * rows, context)], repeats) for rows in sizes}


def middle_tree_step(seq_id: int, context: int, k: int, branches: int) -> Chunk:
    """A tree step of ``branches`` forks spread over the depths, after a ``context``-token prefix:
    the middle step, whose mask is of average width. Its mask shows the glue and the steps before
    it: write them first with ``write_tree_before_middle``."""
    return _tree_layout(seq_id, context, k, branches).step_chunk((k - 1) // 2, torch.ones(branches, dtype=torch.long))


def write_tree_before_middle(executor: Executor, seq_id: int, context: int, k: int, branches: int) -> None:
    """Forward the glue and the tree steps before the middle one, so that the middle step sees
    written KV: an engine that owns its cache (llama.cpp) refuses to attend to unwritten slots."""
    layout = _tree_layout(seq_id, context, k, branches)
    executor.forward([chain_chunk(seq_id, [1] * (k + 1), context)])
    for step in range((k - 1) // 2):
        executor.forward([layout.step_chunk(step, torch.ones(branches, dtype=torch.long))])


def _tree_layout(seq_id: int, context: int, k: int, branches: int) -> TreeLayout:
    return TreeLayout(seq_id, context, k, torch.arange(branches) % (k + 1), torch.ones(branches, dtype=torch.long))


def time_tree_steps(executor: Executor, k: int, max_branches: int = 64, context: int = 128,
                    repeats: int = 3) -> dict[int, float]:
    """{branches: seconds} of tree steps of 1, 2, 4, ... branches of one sequence. A tree step
    attends through a mask, so it costs more than a chain forward of as many rows (12 branches
    of the Qwen2.5-Coder-0.5B draft: 1.5-2.5x a 12-row chain extrapolated, in two calibrations):
    a tree priced as chain forwards looks cheaper than it is, and the auto fan-out grows it past
    the verify window."""
    check_int(k, "k")
    context, sizes = _timing_sizes(executor, max_branches, context, lambda branches: k + 1 + k * branches)
    with scratch_sequences(executor, 1, context) as (sid,):
        times = {}
        for n in sizes:
            write_tree_before_middle(executor, sid, context, k, n)
            times[n] = time_forward(executor, [middle_tree_step(sid, context, k, n)], repeats)
        return times


def _timing_sizes(executor: Executor, most: int, context: int, slots) -> tuple[int, list[int]]:
    """The context and the sizes 1, 2, 4, ... (up to ``most``) whose forward fits the executor's
    token budget and whose ``slots(size)`` region slots fit its sequences after the context."""
    limit = executor.capabilities.max_batch_tokens
    context = max(1, min(context, limit, executor.max_seq_len // 2))
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128)
             if n <= min(most, limit) and context + slots(n) <= executor.max_seq_len]
    return context, sizes or [1]


# --- cached calibrations ------------------------------------------------------------------------
# Timing the draft's forwards takes seconds to tens of seconds at every start (the Qwen pair's
# draft: most of its start-up), and gives the same shape on the same machine for the same model:
# so it is stored per machine and model and reused. The live scale of a `StepCostModel` still
# follows what forwards cost now.

CALIBRATION_CACHE_ENV = "TRTSSD_CALIBRATION_CACHE"  # a directory, or "off" to time at every start


def calibration_key_fields(executor: Executor, **settings: Any) -> dict:
    """What the timed costs depend on: the machine (CPU, cores, threads, torch, trtssd), the
    executor's `cost_identity` (the model's shape and how it runs) and the timing settings."""
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "trtssd": _trtssd_version(),
        **executor.cost_identity(),
        **settings,
    }


def calibration(fields: Mapping[str, Any], measure: Callable[[], tuple[dict, dict]]) -> tuple[dict, dict, bool]:
    """(chain, tree) timings stored for these fields, else ``measure()``'s, stored for the next start;
    and whether they were stored. A file that cannot be read is timed again and replaced; one that
    cannot be written only costs the timing again at the next start."""
    path = _calibration_path(fields)
    stored = _load(path) if path is not None else None
    if stored is not None:
        return stored["chain"], stored["tree"], True
    chain, tree = measure()
    if path is not None:
        _store(path, {"measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "fields": fields, "chain": dict(chain), "tree": dict(tree)})
    return chain, tree, False


def _calibration_path(fields: Mapping[str, Any]) -> Path | None:
    """Where a calibration is kept (default under ~/.cache/trtssd/calibration; deleting the
    directory makes the next start time its forwards again), None when caching is off."""
    value = os.environ.get(CALIBRATION_CACHE_ENV)
    if value is not None and value.strip().lower() in ("off", "0", "no", "false", ""):
        return None
    folder = Path(value) if value else Path.home() / ".cache" / "trtssd" / "calibration"
    key = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return folder / f"{key}.json"


def _load(path: Path) -> dict[str, dict[int, float]] | None:
    """The stored {"chain": {rows: s}, "tree": {branches: s}}, or None (not stored, or unreadable)."""
    try:
        data = json.loads(path.read_text())
        return {part: {int(n): float(s) for n, s in data[part].items()} for part in ("chain", "tree")}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("ignoring unreadable calibration %s (%s); timing again", path, err)
        return None


def _store(path: Path, record: dict) -> None:
    """Written whole or not at all."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(record, indent=1, default=str) + "\n")
        os.replace(partial, path)
    except OSError as err:
        log.warning("could not store the calibration in %s: %s", path.parent, err)


def calibrated_forwards(executor: Executor, max_rows: int, context: int = 128, **settings: Any) -> dict[int, float]:
    """`time_forwards`, stored per machine and model like the draft's calibration (``settings``
    join the key: e.g. which rank times them)."""
    fields = calibration_key_fields(executor, max_rows=max_rows, context=context, **settings)
    return calibration(fields, lambda: (time_forwards(executor, max_rows, context), {}))[0]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _trtssd_version() -> str:
    try:
        return importlib.metadata.version("trtssd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
