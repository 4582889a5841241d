"""CPU cores: each rank (or one thread of it) pinned to its own, with its torch thread count.

Every process we start pins itself (the target in `LLM`, the draft rank, a tensor-parallel
follower); plain rounds borrow the draft's cores (trtssd/runtime/core_lending.py).
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

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
