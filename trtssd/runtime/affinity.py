"""Pin a rank to its CPU cores and set its torch thread count (CPU machines)."""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

log = logging.getLogger(__name__)


def default_cores(role: str) -> tuple[int, ...] | None:
    """Target on the first core, draft on the last, when there is more than one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    return (cores[0],) if role == "target" else (cores[-1],)


def pin(role: str, cores: Sequence[int] | None, threads: int) -> None:
    cores = tuple(cores) if cores is not None else default_cores(role)
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError as err:  # e.g. cores outside this container's cpuset
            log.warning("could not pin the %s rank to cores %s: %s", role, cores, err)
    torch.set_num_threads(threads)
    log.info("%s rank: cores %s, %d torch thread(s)", role, cores or "unpinned", threads)
