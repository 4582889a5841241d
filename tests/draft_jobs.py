"""The draft rank's MPI job as the tests see it (launch "spawn", tiny models): an `LLM` that starts
one, its processes, and the shared memory and MPICH files it holds, to check that none outlives it
(the fixture `no_leaked_shared_memory` in conftest.py)."""

from __future__ import annotations

import glob
import os
import signal
import sys
import tempfile
from pathlib import Path

import psutil

from trtssd import LLM, ModelRef
from trtssd.processes import mapped_segments, open_files, start_time


def spawned_llm(pair: tuple[Path, Path], mode: str, **kw) -> LLM:
    """``pair``'s target here, its draft its own MPI job, max_model_len 256."""
    target, draft = pair
    kw.setdefault("max_model_len", 256)
    # On these tiny models a plain target step costs less than an MPI round trip, so load
    # control would decode most rounds plainly; the tests are about the speculative paths.
    kw.setdefault("plain_under_load", False)
    return LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode=mode, **kw)


BINDIR = Path(sys.executable).parent  # this environment's mpiexec beside its python


def child_env() -> dict[str, str]:
    """The environment of a target started as a child: this environment's mpiexec first on PATH,
    this checkout's trtssd first on PYTHONPATH."""
    return dict(os.environ, PATH=f"{BINDIR}:{os.environ.get('PATH', '')}", PYTHONPATH=str(Path(__file__).parents[1]))


def shm_segments() -> set[str]:
    """Our shared buffers and MPICH's own segments (every MPI process makes a mpich_shm_* in
    MPI_Init and removes it in MPI_Finalize, which a killed process never reaches)."""
    return {os.path.basename(p) for p in glob.glob("/dev/shm/trtssd-*") + glob.glob("/dev/shm/mpich_*")}


def in_use_segments() -> set[str]:
    """Segments in use, not leaked: those other live processes map (other programs' while they
    run) and this process's own MPI segment (MPICH removes it in MPI_Finalize, at exit)."""
    own_mpi = mapped_segments(os.getpid(), ("mpich_",))
    return own_mpi.union(*(mapped_segments(pid, ("",)) for pid in psutil.pids() if pid != os.getpid()))


def draft_segments(draft_pid: int) -> set[str]:
    """The draft rank's segments: our buffers and its MPICH segment (checked to exist)."""
    segments = mapped_segments(draft_pid, ("",)) & shm_segments()
    assert any(n.startswith("trtssd-") for n in segments), segments  # the buffers are real shared memory
    assert any(n.startswith("mpich_shm_") for n in segments), segments  # the draft job's own MPI segment
    return segments


def hydra_files() -> set[str]:
    """MPICH hydra's temporary topology files: mpiexec writes one per job, its proxy holds it
    open, and only a clean exit removes it."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "hydra_hwloc_xmlfile_*")))


def open_hydra_files() -> set[str]:
    """Hydra files some live process (another job's mpiexec or proxy) still holds open."""
    return set().union(*(open_files(pid, ("hydra_hwloc_xmlfile_",)) for pid in psutil.pids()))


def draft_job(draft_pid: int, target_pid: int | None = None) -> set[int]:
    """Every process of the draft's MPI job: the rank, its children and its ancestors below the
    target process (hydra_pmi_proxy, mpiexec); the target is this process unless given."""
    target_pid = target_pid or os.getpid()
    rank = psutil.Process(draft_pid)
    ancestors = [p.pid for p in rank.parents()]
    assert target_pid in ancestors, "the draft job is not a child of the target"
    job = {draft_pid, *ancestors[:ancestors.index(target_pid)], *(c.pid for c in rank.children(recursive=True))}
    assert len(job) >= 3, job  # at least mpiexec, hydra_pmi_proxy and the rank
    return job


def still_running(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running or stopped (a zombie has ended: it only awaits its reaper)."""
    return {pid for pid in pids if start_time(pid) is not None}


def kill_running(pids: set[int]) -> None:
    """Test cleanup: a failed check must not leave stopped processes on the machine."""
    for pid in still_running(pids):
        os.kill(pid, signal.SIGKILL)
