"""Launch "world": trtssd's ranks as the ranks of one ``mpiexec -n T+1`` job.

Ranks 0..T-1 are the target (T = ``tensor_parallel_size``; rank 0 leads and runs ``LLM``), the
last rank, T, is the draft. Every rank runs the same program; `serve_world_rank` sends each rank
other than 0 to its part, so a script (or ``trtssd generate|serve --launch world``) reads::

    if serve_world_rank(tensor_parallel_size):   # ranks 1..T: served until rank 0 closed
        sys.exit(0)
    with LLM(..., launch="world", tensor_parallel_size=T) as llm: ...

At T = 1 the job is the target and the draft alone, and the draft talks to rank 0 over the
whole world. At T > 1 two communicators are split from it (collectively, once per process, in
the same order on every rank): the target ranks' (rank 0 tells its followers, over it, where
its torch.distributed store listens; trtssd/backends/tensor_parallel.py) and the link of rank 0
and the draft (the draft's round buffers are a shared window over these two ranks only).

A lost rank ends the job: MPICH's mpiexec kills every rank when one dies, so requests in flight
are lost with it (launch "spawn" ends them with an error instead and goes on:
docs/design/tensor-parallelism.md). The one thing a killed MPICH job would leave, its
shared-memory segment (/dev/shm/mpich_shm_*, unlinked only when every rank finalizes), has lost
its name already: rank 0 unlinks it as soon as every rank has attached it (`world_groups`), as a
segment meant to vanish with its last user is made; the ranks' mappings stay valid until they exit.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trtssd.processes import SHM_DIR, mapped_segments, remove_files
from trtssd.runtime.transport import MPICH_SHM_PREFIXES, require_mpi

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldGroups:
    """This process's communicators in a launch "world" job."""

    rank: int  # in COMM_WORLD
    tensor_parallel_size: int
    targets: MPI.Intracomm | None  # ranks 0..T-1 (T > 1; None on the draft rank and at T = 1)
    link: MPI.Intracomm | None  # rank 0 (its rank 0) and the draft (its last rank); None on followers


@functools.lru_cache(maxsize=None)
def world_groups(tensor_parallel_size: int) -> WorldGroups:
    """This process's communicators; the first call is collective over COMM_WORLD (every rank
    makes it, with the same size) and later calls return the same groups."""
    mpi = require_mpi("launch='world'")
    world = mpi.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    _check_one_host(world)  # collective: every rank is past MPI_Init, its segment attached
    if rank == 0:
        removed = remove_files(SHM_DIR + name for name in mapped_segments(os.getpid(), MPICH_SHM_PREFIXES))
        log.debug("unlinked MPICH's segments, attached by every rank: %s", removed)
    if size != tensor_parallel_size + 1:
        raise ValueError(f"launch 'world' with tensor_parallel_size={tensor_parallel_size} needs mpiexec -n "
                         f"{tensor_parallel_size + 1} (ranks 0..{tensor_parallel_size - 1} the target, rank "
                         f"{tensor_parallel_size} the draft); this job has {size} ranks")
    if tensor_parallel_size == 1:
        return WorldGroups(rank, 1, None, world)
    targets = world.Split(0 if rank < tensor_parallel_size else mpi.UNDEFINED, rank)
    link = world.Split(0 if rank in (0, tensor_parallel_size) else mpi.UNDEFINED, rank)
    return WorldGroups(rank, tensor_parallel_size, None if targets == mpi.COMM_NULL else targets,
                       None if link == mpi.COMM_NULL else link)


def _check_one_host(world: MPI.Intracomm) -> None:
    """The target ranks meet on rank 0's loopback and the draft's buffers are shared memory: one host."""
    hosts = set(world.allgather(require_mpi("launch='world'").Get_processor_name()))
    if len(hosts) > 1:
        raise ValueError(f"launch 'world' runs every rank on one host; this job spans {sorted(hosts)}")


def serve_world_rank(tensor_parallel_size: int) -> bool:
    """On ranks 1..T of a launch "world" job: serve this rank's part (a target follower, or the
    draft) until rank 0 shuts it down, and return True. On rank 0 return False, to go on to
    ``LLM``. Collective: every rank of the job calls it first."""
    groups = world_groups(tensor_parallel_size)
    if groups.rank == 0:
        return False
    if groups.rank == tensor_parallel_size:  # the last rank: the draft
        from trtssd.runtime.draft_rank import serve

        serve(groups.link, target_rank=0)
    else:
        from trtssd.backends.tensor_parallel import serve_in_world

        serve_in_world(groups.targets)
    return True


def end_world_job(error: BaseException) -> None:
    """Rank 0 could not start: its followers and the draft wait for it, in collectives only it
    can complete, so the job ends here (MPI_Abort), after saying why. Returns only outside an
    MPI job (nothing waits then)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return
    log.error("rank 0 could not start (%s: %s): ending the mpiexec job", type(error).__name__, error)
    traceback.print_exception(error, file=sys.stderr)
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(1)
