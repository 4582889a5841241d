"""Core lending: plain rounds run on the target's cores and the draft's, speculative rounds on the
target's own (the cores themselves: trtssd/cores.py)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from trtssd.backends.base import Executor
from trtssd.cores import pin_thread

T = TypeVar("T")


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
    """``fn()`` on a thread of its own, which has ended when this returns (or raises ``fn``'s
    exception). The cores a timing run pins belong to that thread, and the OpenMP workers
    llama.cpp starts for its forwards (with that thread's cores, for as long as it lives) end with
    it: started from the constructing thread, they would stay pinned to the cores of the last
    timed forward and slow every plain round after it."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trtssd-timing") as thread:
        return thread.submit(fn).result()


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
