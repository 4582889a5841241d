"""Pin a rank to its CPU cores and set its torch thread count (CPU machines)."""

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
    """Pin this process; returns the previous (affinity, threads) so a caller can restore them."""
    previous = (os.sched_getaffinity(0), torch.get_num_threads())
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError as err:  # e.g. cores outside this container's cpuset
            log.warning("could not pin the %s rank to cores %s: %s", role, cores, err)
    torch.set_num_threads(threads)
    log.info("%s rank: cores %s, %d torch thread(s)", role, cores or "unpinned", threads)
    return previous


def restore(previous: tuple[set[int], int]) -> None:
    os.sched_setaffinity(0, previous[0])
    torch.set_num_threads(previous[1])
