"""Nothing is left behind by a process that ends abruptly: no shared-memory segment of ours or of
MPICH's. MPICH creates a /dev/shm/mpich_shm_* segment in MPI_Init and removes it only in
MPI_Finalize, which a SIGKILLed process never reaches, so a process may initialise MPI only when
it really talks MPI (launch "spawn" or "world"), and one that did must finalise it at exit.

Each test runs its subject in a child process and looks only at that child's segments (the ones
it maps, and MPICH's one named after its pid), so tests running at the same time do not interfere.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_models import make_tiny_pair
from trtssd.processes import ProcessTree, descendants, mapped_segments, start_time

READY_TIMEOUT_S = 240.0  # a child importing torch and loading two tiny models on a busy machine

LOCAL_LLM_SCRIPT = """
import sys, time
from trtssd import LLM, ModelRef, SamplingParams
llm = LLM(target=ModelRef(sys.argv[1]), draft=ModelRef(sys.argv[2]), mode='ssd', launch='local', max_model_len=64,
          plain_under_load=False)
llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
print('ready', flush=True)
time.sleep(600)
"""

MPI_USER_SCRIPT = """
import os
from trtssd.processes import mapped_segments
from trtssd.runtime.transport import require_mpi
MPI = require_mpi('this test')
assert MPI.Is_initialized() and not MPI.Is_finalized()
assert MPI.Query_thread() == MPI.THREAD_MULTIPLE, MPI.Query_thread()
print('mpich' if mapped_segments(os.getpid(), ('mpich_',)) else 'no mpich segment', flush=True)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))


def _shm_of(pid: int) -> set[str]:
    """The /dev/shm entries process ``pid`` maps (not yet unlinked), plus MPICH's segments named
    after it (a singleton MPI process's is mpich_shm_<pid in hex>_<n>)."""
    mapped = mapped_segments(pid, ("",))  # every prefix
    named = {os.path.basename(p) for p in glob.glob(f"/dev/shm/mpich_shm_{pid:x}_*")}
    return mapped | named


def _existing(names: set[str]) -> set[str]:
    return {n for n in names if os.path.exists(f"/dev/shm/{n}")}


def _wait_for_ready(proc: subprocess.Popen, stderr: Path) -> None:
    """Until the child prints "ready"; fails the test (with its stderr) if it exits or hangs first."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        # select, not a bare readline: a hung child must fail the test, not hang it
        if select.select([proc.stdout], [], [], 1.0)[0] and proc.stdout.readline().strip() == "ready":
            return
    pytest.fail(f"the child did not get ready (exit code {proc.poll()}): {stderr.read_text()[-2000:]}")


def test_killed_local_llm_leaves_no_shared_memory(tiny, tmp_path):
    """LLM(launch='local') runs the draft in-process and needs no MPI: SIGKILLed, it leaves no
    /dev/shm segment (before the fix, importing the runtime ran MPI_Init, whose MPICH segment a
    killed process never removes)."""
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", LOCAL_LLM_SCRIPT, str(tiny[0]), str(tiny[1])],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=_env())
    try:
        _wait_for_ready(proc, stderr)
        segments = _shm_of(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    left = _existing(segments)
    for name in left:  # the child's leak, not the next run's problem
        os.unlink(f"/dev/shm/{name}")
    assert not left, f"SIGKILL left shared memory behind: {sorted(left)}"
    assert not segments, f"a local-launch process holds shared memory: {sorted(segments)}"


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")
def test_process_that_used_mpi_finalizes_it_at_exit():
    """A process that initialised MPI (require_mpi) removes MPICH's segment at a normal exit, and
    got the thread level mpi4py would have asked for."""
    proc = subprocess.Popen([sys.executable, "-c", MPI_USER_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == "mpich", out  # MPI really was initialised: it made its segment
    left = {os.path.basename(p) for p in glob.glob(f"/dev/shm/mpich_shm_{proc.pid:x}_*")}
    for name in left:  # the child's leak, not the next run's problem
        os.unlink(f"/dev/shm/{name}")
    assert not left, f"MPI_Finalize did not run at exit: {sorted(left)}"


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")
def test_user_mpi_import_after_trtssd_still_initialises_mpi():
    """A launch='world' script may import trtssd first and then use mpi4py itself (the last rank
    serves as the draft): deferring our MPI_Init must not change mpi4py's for the user."""
    code = ("import trtssd.llm, trtssd.runtime.launch\n"
            "from mpi4py import MPI\n"
            "print(MPI.Is_initialized(), MPI.COMM_WORLD.Get_size())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "1"], proc.stdout



TREE_CHILD = """
import subprocess, sys
subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]], start_new_session=True)
"""

TREE_GRANDCHILD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)
os.ftruncate(fd, 4096)
segment = mmap.mmap(fd, 4096)
time.sleep(600)
"""


def test_ending_a_process_tree_kills_a_stopped_grandchild_and_removes_its_segment(tmp_path):
    """As hydra's proxy and rank are, the grandchild runs in a session of its own; stopped, it
    never acts on a signal its parent could pass on: ProcessTree.end kills the tree's processes
    one by one and removes the segment the grandchild mapped."""
    prefix = f"trtssd-test-tree-{os.getpid()}"
    path = f"/dev/shm/{prefix}"
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        tree = ProcessTree([sys.executable, "-c", TREE_CHILD, TREE_GRANDCHILD, path], stderr=err,
                           shm_prefixes=(prefix,))
    processes = [tree.process.pid]
    try:
        deadline = time.monotonic() + 60
        while not any(mapped_segments(pid, (prefix,)) for pid in descendants(tree.process.pid)):
            assert tree.running() and time.monotonic() < deadline, stderr.read_text()
            time.sleep(0.05)
        tree.record()
        processes += descendants(tree.process.pid)
        for pid in processes:
            os.kill(pid, signal.SIGSTOP)
        leftovers = tree.end()
        assert not [pid for pid in processes if start_time(pid) is not None]
        assert sorted(leftovers.killed) == sorted(processes) and leftovers.removed == [path]
        assert not os.path.exists(path)
    finally:
        for pid in processes:
            if start_time(pid) is not None:
                os.kill(pid, signal.SIGKILL)
        tree.end()
        if os.path.exists(path):
            os.unlink(path)
