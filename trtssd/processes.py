"""The processes we start (the draft's MPI job, tritonserver) and what they leave behind, through psutil.

`ProcessTree` starts a command in a session of its own, so a terminal's Ctrl-C or hang-up reaches
only this process, which then decides how the child ends. While the child runs, `record` notes
every process below it and the /dev/shm segments and temporary files they hold; `end` kills
whatever of them is still running, one by one (MPICH's hydra puts its proxy and ranks in sessions
of their own, so neither a process-group kill nor killing the root reaches a stopped or hung
rank), and removes those segments and files: only what was recorded, never another program's.
A process is known by its pid *and* start time, so a pid reused later is never taken for ours.
A zombie counts as ended: it only waits for its parent (maybe init) to reap it.

`exit_with` is the other direction: a child that ends itself once the process that started it is
gone. The query functions give empty answers for a process that is gone or that we may not inspect.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm/"
# How long ending a tree waits for its killed processes to disappear (SIGKILL acts at once, even on
# a stopped process; this only bounds a process stuck in the kernel).
KILL_WAIT_S = 10.0
POLL_S = 0.02
# How often `exit_with` looks at the watched process: psutil's wait() is no help for a process
# that is not our child, as it waits until its zombie is reaped, which may be never.
WATCH_INTERVAL_S = 0.2
_UNSEEN = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


# --- what the system says about a process --------------------------------------------------------

def start_time(pid: int) -> float | None:
    """Process start time (seconds since the epoch); None when gone or a zombie."""
    try:
        process = psutil.Process(pid)
        return process.create_time() if _running(process) else None
    except _UNSEEN:
        return None


def descendants(root: int) -> list[int]:
    """Every process below ``root``."""
    try:
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    except _UNSEEN:
        return []


def mapped_segments(process: int | psutil.Process, prefixes: tuple[str, ...]) -> set[str]:
    """Names of the /dev/shm segments starting with one of ``prefixes`` that ``process`` maps."""
    try:
        maps = _as_process(process).memory_maps(grouped=True)
    except _UNSEEN:
        return set()
    # psutil strips the " (deleted)" mark of an unlinked file, so whether it still exists is asked.
    return {region.path[len(SHM_DIR):] for region in maps
            if region.path.startswith(SHM_DIR) and region.path[len(SHM_DIR):].startswith(prefixes)
            and os.path.exists(region.path)}


def open_files(process: int | psutil.Process, name_prefixes: tuple[str, ...]) -> set[str]:
    """Paths of the files ``process`` holds open whose name starts with one of ``name_prefixes``."""
    try:
        files = _as_process(process).open_files()
    except _UNSEEN:
        return set()
    return {f.path for f in files if os.path.basename(f.path).startswith(name_prefixes)}


def remove_files(paths: Iterable[str]) -> list[str]:
    """Remove those of ``paths`` that exist; returns the ones removed."""
    removed = []
    for path in sorted(paths):
        with contextlib.suppress(FileNotFoundError):  # its owner removed it: it exited cleanly
            os.unlink(path)
            removed.append(path)
    return removed


def _as_process(process: int | psutil.Process) -> psutil.Process:
    return process if isinstance(process, psutil.Process) else psutil.Process(process)


def _running(process: psutil.Process) -> bool:
    """Running or stopped: not gone, not a zombie, not a new process under a reused pid."""
    try:
        return process.is_running() and process.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except _UNSEEN:
        return False


def _wait_until_ended(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of ``processes`` still running after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return left


# --- a child and everything it starts -------------------------------------------------------------

@dataclass(frozen=True)
class Leftovers:
    """What `ProcessTree.end` had to do: its callers say whether that was expected."""

    killed: list[int]  # pids still running when it ended the tree
    removed: list[str]  # segments and files it removed


class ProcessTree:
    """``command`` started in a session of its own (its stdin closed), every process below it, and
    the /dev/shm segments (names starting with ``shm_prefixes``) and files (``file_prefixes``) they
    hold; see the module docstring. ``ignored_segments`` are never removed (this process's own)."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None, stdout=None, stderr=None,
                 shm_prefixes: tuple[str, ...] = (), file_prefixes: tuple[str, ...] = (),
                 ignored_segments: Iterable[str] = ()):
        self._shm_prefixes = shm_prefixes
        self._file_prefixes = file_prefixes
        self._ignored = {SHM_DIR + name for name in ignored_segments}
        self._processes: set[psutil.Process] = set()  # equal when pid and start time are
        self._paths: set[str] = set()  # segments and files to remove once the tree is over
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                        start_new_session=True)

    @property
    def name(self) -> str:
        return os.path.basename(self.process.args[0])

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout_s: float) -> int | None:
        """The root's exit code once it exits by itself; None if it still runs after ``timeout_s``."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def record(self) -> None:
        """Note the tree's processes and what they hold (call while it runs: a process whose parent
        died is no longer found below the root)."""
        if not self.running():
            return
        try:
            root = psutil.Process(self.process.pid)
            self._processes |= {root, *root.children(recursive=True)}
        except _UNSEEN:
            return
        for process in self._live_processes():
            self._paths |= {SHM_DIR + name for name in mapped_segments(process, self._shm_prefixes)}
            self._paths |= open_files(process, self._file_prefixes)
        self._paths -= self._ignored

    def stop(self, timeout_s: float) -> int:
        """SIGTERM to the root, SIGKILL if it is still running after ``timeout_s``; its exit code.
        What the root started is left to `end`."""
        self.record()
        if self.running():
            self.process.terminate()
            if self.wait(timeout_s) is None:
                log.warning("%s did not stop within %.0f s: killing it", self.name, timeout_s)
                self.process.kill()
        return self.process.wait()

    def end(self, grace_s: float = 0.0) -> Leftovers:
        """Give the recorded processes ``grace_s`` to exit by themselves, kill those that did not,
        then remove the recorded segments and files that still exist (idempotent)."""
        self.record()  # processes started since the last look
        left = _wait_until_ended(self._live_processes(), grace_s)
        for process in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()  # psutil checks the start time first: never a stranger's process
        if self.running():
            self.process.kill()  # where nothing was recorded: the root at least
        self.process.wait()  # the root is our child: reap it
        if survivors := _wait_until_ended(left, KILL_WAIT_S):
            log.warning("processes %s of %s did not end after SIGKILL", [p.pid for p in survivors], self.name)
        removed = remove_files(self._paths)
        self._paths.clear()
        return Leftovers([p.pid for p in left], removed)

    def _live_processes(self) -> list[psutil.Process]:
        return [p for p in self._processes if _running(p)]


# --- a child ending with its parent ---------------------------------------------------------------

def _wait_for_exit(pid: int) -> None:
    """Block until process ``pid`` exits, without waking meanwhile (a pidfd, Linux 5.3+); return
    at once where that is unavailable (the caller then polls)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def exit_with(pid: int, before_exit: Callable[[], None]) -> None:
    """Call in a child: once process ``pid`` has ended (killed, say, before it could stop this
    one), run ``before_exit`` and exit at once with status 1 (``os._exit``: a clean exit could
    wait forever on a peer that is gone). Watched from a daemon thread."""
    try:
        watched = psutil.Process(pid)
    except psutil.NoSuchProcess:
        watched = None  # gone already

    def watch() -> None:
        _wait_for_exit(pid)
        while watched is not None and _running(watched):
            time.sleep(WATCH_INTERVAL_S)
        before_exit()
        os._exit(1)

    threading.Thread(target=watch, name=f"exit-with-{pid}", daemon=True).start()
