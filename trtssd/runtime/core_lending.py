"""Pin a rank (or one thread of it) to its CPU cores and set its torch thread count (CPU machines)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from trtssd.backends.base import Executor

T = TypeVar("T")

log = logging.getLogger(__name__)


def split_cores(target_threads: int, draft_threads: int) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """Disjoint core sets for target and draft (target first), or (None, None) when the
    machine has too few cores to give each rank its own."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    n_target = max(1, min(target_threads, len(cores) - 1))
    n_draft = max(1, min(draft_threads, len(cores) - n_target))
    return tuple(cores[:n_target]), tuple(cores[-n_draft:])


def pin(role: str, cores: Sequence[int] | None, threads: int) -> tuple[set[int], int]:
    """Pin the calling thread (and the threads it starts from now on) and set torch's thread
    count; returns the previous (affinity, threads) so a caller can restore them."""
    previous = (os.sched_getaffinity(0), torch.get_num_threads())
    pin_thread(f"{role} rank", cores)
    torch.set_num_threads(threads)
    log.info("%s rank: cores %s, %d torch thread(s)", role, cores or "unpinned", threads)
    return previous


def pin_thread(role: str, cores: Sequence[int] | None) -> None:
    """Pin the calling thread only: on Linux an affinity belongs to a thread, and the threads it
    starts afterwards inherit it. None or empty: leave it as it is."""
    if not cores:
        return
    try:
        os.sched_setaffinity(0, cores)
    except OSError as err:  # e.g. cores outside this container's cpuset
        log.warning("could not pin the %s to cores %s: %s", role, cores, err)


def cores_besides(busy: Sequence[int] | None, allowed: set[int]) -> tuple[int, ...]:
    """``allowed`` without the ``busy`` cores, or all of ``allowed`` when that leaves none."""
    rest = set(allowed) - set(busy or ())
    return tuple(sorted(rest or allowed))


def restore(previous: tuple[set[int], int]) -> None:
    os.sched_setaffinity(0, previous[0])
    torch.set_num_threads(previous[1])


@dataclass
class CoreLending:
    """The target's cores for speculative rounds, and the draft's besides them for plain rounds.

    On CPU a plain round leaves the draft rank idle (it has nothing to pre-speculate), so its
    cores are better spent on the target: on a 2-core machine plain decoding on both beats
    anything that keeps one for a draft. Only executors whose rows do not depend on their thread
    count for multi-token forwards lend (the ggml executor: trtssd/backends/ggml_backend.py says
    what a one-token forward on several threads changes)."""

    executor: Executor  # one whose capabilities lend threads
    own: tuple[tuple[int, ...] | None, int]  # (cores, threads) of speculative rounds
    lent: tuple[tuple[int, ...] | None, int]  # (cores, threads) of plain rounds
    split_single_rows: bool = False  # RuntimeConfig.lend_draft_cores "always"
    _applied: tuple[int, bool] | None = None  # (thread, plain) last applied

    def forget_threads(self) -> None:
        """The thread that applied cores last has ended: the next round applies them again
        (a new thread may get the ended one's id)."""
        self._applied = None

    def for_round(self, plain: bool) -> None:
        """Take the cores of the coming forwards (on the thread that runs them: an affinity
        belongs to a thread, and llama.cpp's workers inherit it)."""
        key = (threading.get_ident(), plain)
        if key == self._applied:
            return
        cores, threads = self.lent if plain else self.own
        pin_thread("target rank", cores)
        self.executor.set_threads(threads, self.split_single_rows)
        self._applied = key


def on_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own, its result or its exception here. The cores a timing run
    pins belong to that thread, and the OpenMP workers llama.cpp starts for its forwards (with
    that thread's cores, for as long as it lives) end with it: started from the constructing
    thread, they would stay pinned to the cores of the last timed forward and slow every plain
    round after it."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            result.append((False, err))

    thread = threading.Thread(target=run, name="trtssd-timing")
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def core_lending(executor: Executor, target_cores: Sequence[int] | None, target_threads: int,
                 draft_cores: Sequence[int] | None, draft_threads: int,
                 split_single_rows: bool = False) -> CoreLending | None:
    """The lending for a target executor, or None when it cannot lend (its capabilities say so,
    or the draft has no cores of its own to borrow)."""
    if not executor.capabilities.lends_threads or not target_cores or not draft_cores:
        return None
    lent = tuple(sorted(set(target_cores) | set(draft_cores)))
    return CoreLending(executor, (tuple(target_cores), target_threads), (lent, target_threads + draft_threads),
                       split_single_rows)
