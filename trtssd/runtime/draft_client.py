"""The target's side of the draft rank: what the target loop needs of it (`DraftClient`), the
real one (`DraftLink`: start it, talk to it, notice when it is gone) and an in-process one.

`LocalDraft` runs the same `DraftServer` and `DraftWorker` in this process, synchronously (tests
without MPI, single-process debugging): it pre-speculates right after answering instead of during
the verification, and a new sequence's first round just before answering it instead of during
the target's prefill, which changes timing, never tokens.

Two ways to get a draft rank:
- `DraftLink.spawn`: the Python API starts the draft as its own one-process MPI job and accepts
  its connection on an MPI port (MPI dynamic process management), so a user never calls mpiexec.
  MPICH ends every process of a job when one dies (``MPI_Comm_spawn`` children included), so a
  separate job is what lets the target outlive a dead draft. Bulk rows use POSIX shared memory.
- `DraftLink.from_world`: under ``mpiexec -n 2``, the last rank of COMM_WORLD is the draft and
  the bulk rows use an MPI-3 shared-memory window. A dying rank there takes the job down (MPICH
  has no fault tolerance); timeouts still degrade to AR.

With the draft on CUDA (``draft_device``), either way, the bulk rows use CUDA IPC buffers instead
(cuda_ipc.py): the draft allocates them on its GPU and sends their handles in Ready.

Any failure (timeout, exit, DraftError) marks the link dead; the engine then decodes in AR mode
from its own state, so nothing is lost. A dead draft's job is ended whole (`_end_job`): its
processes are killed and the shared memory MPICH would have removed at MPI_Finalize is removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from trtssd.config import ModelRef, RuntimeConfig, SpeculativeConfig, Transport
from trtssd.processes import ProcessTree, mapped_segments, start_time
from trtssd.runtime import protocol as P
from trtssd.runtime.cuda_ipc import CudaIpcBuffers
from trtssd.runtime.draft_rank import DraftServer
from trtssd.runtime.draft_worker import DraftWorker
from trtssd.runtime.transport import (MPICH_SHM_PREFIXES, Channel, Doorbell, PeerLost, RoundBuffers, SharedBuffers,
                                      require_mpi)

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger(__name__)

# Where the target reads the draft's rows: its verification math runs on the host.
HOST = torch.device("cpu")


class DraftClient(Protocol):
    alive: bool  # False once the draft is lost; the target then decodes in ar mode
    pid: int | None
    step_s: dict[int, float] | None  # the draft's calibrated seconds per forward by rows (None: not timed)

    def send(self, msg: object) -> bool:
        """Send a Prefill or Release; False when the draft is gone (nothing was sent)."""

    def speculate(self, req: P.SpeculateRequest) -> tuple[P.SpeculateReply, torch.Tensor, torch.Tensor | None]:
        """The speculation rows for ``req``: (reply, tokens [B, K], q' rows [B, K, V] or None).
        Raises PeerLost when the draft fails or does not answer; the client is then dead."""

    def mark_dead(self, reason: str) -> None: ...

    def close(self) -> None: ...


def _mark_lost(client: LocalDraft | DraftLink, what: str, reason: str) -> None:
    """A draft client's draft is gone: the target decodes in ar mode from now on (logged once)."""
    if client.alive:
        log.warning("%s lost (%s): continuing in ar mode", what, reason)
    client.alive = False
    client.failure = reason


class LocalDraft:
    def __init__(self, worker: DraftWorker, max_batch: int):
        # Host buffers whatever the draft's device: CUDA cannot open a process's own IPC handles.
        layout = P.BufferLayout(max_batch, worker.k, worker.executor.vocab_size, None)
        self.server = DraftServer(worker, SharedBuffers(layout, bytearray(SharedBuffers.nbytes(layout)), lambda: None))
        self.alive = True
        self.failure: str | None = None
        self.pid = os.getpid()
        self.step_s = worker.calibrated_step_s

    def send(self, msg: object) -> bool:
        if not self.alive:
            return False
        try:
            self.server.handle(msg)
        except Exception as err:  # noqa: BLE001 - a failing draft degrades the target, as over MPI
            self.mark_dead(f"draft error: {type(err).__name__}: {err}")
            return False
        return True

    def speculate(self, req: P.SpeculateRequest) -> tuple[P.SpeculateReply, torch.Tensor, torch.Tensor | None]:
        if not self.alive:
            raise PeerLost(self.failure or "draft unavailable")
        try:
            self.server.when_idle()  # where the draft rank would have been idle: the target's prefill
            reply = self.server.handle(req)
            self.server.after_reply()
        except Exception as err:  # noqa: BLE001 - reported as a lost draft, as over MPI
            self.mark_dead(f"draft error: {type(err).__name__}: {err}")
            raise PeerLost(self.failure) from err
        tokens, probs = self.server.buffers.receive(reply.buffer, len(req.outcomes), reply.has_probs, HOST)
        return reply, tokens, probs

    def mark_dead(self, reason: str) -> None:
        _mark_lost(self, "draft", reason)

    def close(self) -> None:
        self.alive = False
        self.server.worker.executor.close()


def _mpiexec() -> str:
    """The mpiexec next to this interpreter (the mpich wheel's), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: install the 'mpich' wheel (pip install mpich)")
    return found


# How long close() lets a draft that got Shutdown exit by itself (MPI_Finalize, interpreter exit)
# before it is killed; a clean exit takes well under a second.
EXIT_GRACE_S = 30.0
HYDRA_TEMP_PREFIXES = ("hydra_hwloc_xmlfile_",)


def _start_job(command: list[str], env: dict[str, str]) -> ProcessTree:
    """The draft's MPI job, ended whole (`_end_job`) once it is over.

    ``mpiexec`` starts ``hydra_pmi_proxy``, which starts the python rank; hydra puts each in a new
    session, so the tree's processes are recorded and killed one by one. Every MPICH process
    creates a 1 MiB segment /dev/shm/mpich_shm_<job hash>_<node> in MPI_Init and removes it in
    MPI_Finalize, which a killed rank never reaches: the segments the job maps are recorded while
    it runs (their name hashes the job's PMI key-value space name, which includes a random number,
    so it cannot be derived from outside). Hydra likewise writes its hardware topology to a
    temporary file (hydra_hwloc_xmlfile_*) that its proxy holds open and that only a clean exit
    removes. This process's own MPI segment is never the job's to remove.
    """
    return ProcessTree(command, env=env, shm_prefixes=MPICH_SHM_PREFIXES, file_prefixes=HYDRA_TEMP_PREFIXES,
                       ignored_segments=mapped_segments(os.getpid(), MPICH_SHM_PREFIXES))


def _end_job(job: ProcessTree) -> None:
    """Kill whatever is left of the draft job and remove what it left (idempotent)."""
    removed = job.end().removed
    if removed:  # expected after a killed or hung draft
        log.info("removed what the draft job left (MPICH shared memory, hydra files): %s", ", ".join(removed))


class DraftLink:
    def __init__(self, comm: MPI.Intracomm, peer: int, job: ProcessTree | None, timeout_s: float):
        self.comm = comm
        self.channel = Channel(comm, peer)
        self.job = job  # None when the draft is a rank of our own MPI job (launch="world")
        self.timeout_s = timeout_s
        self.buffers: RoundBuffers | None = None
        self.alive = True
        self.failure: str | None = None
        self.pid: int | None = None
        self._started: float | None = None  # the draft process's start time (a world rank's liveness)
        self.step_s: dict[int, float] | None = None
        self._inter: MPI.Intercomm | None = None
        self._closed = False

    # --- start -------------------------------------------------------------------------------

    @classmethod
    def spawn(cls, draft_model: ModelRef, spec: SpeculativeConfig, runtime: RuntimeConfig, vocab_size: int,
              max_seq_len: int, start_timeout_s: float = 300.0) -> "DraftLink":
        mpi = require_mpi("launch='spawn'")
        port = mpi.Open_port()
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        level = logging.getLevelName(logging.getLogger("trtssd").getEffectiveLevel())
        cmd = [_mpiexec(), "-n", "1", sys.executable, "-m", "trtssd.runtime.draft_rank",
               "--port", port, "--log-level", str(level), "--target-pid", str(os.getpid())]
        job = _start_job(cmd, env)
        link = None
        try:
            inter = _accept(port, job, start_timeout_s)  # closes the port when it fails
            mpi.Close_port(port)
            job.record()  # the rank is past MPI_Init: its MPICH segment exists
            link = cls(inter.Merge(high=False), 1, job, spec.draft_timeout_s)
            link._inter = inter
            if runtime.resolved_transport is Transport.HOST:  # else the draft allocates them on its GPU
                link.buffers = SharedBuffers.create_posix(runtime.max_batch, spec.k, vocab_size)
            link._handshake(spec, runtime, vocab_size, draft_model, max_seq_len, start_timeout_s)
            job.record()  # and whatever the rank started while loading
        except BaseException:
            # Whatever state the draft is in, end its job and free what we made for it.
            if link is None:
                _end_job(job)
            else:
                link.alive = False
                link.close()
            raise
        return link

    @classmethod
    def from_world(cls, comm: MPI.Intracomm, draft_model: ModelRef, spec: SpeculativeConfig, runtime: RuntimeConfig,
                   vocab_size: int, max_seq_len: int, start_timeout_s: float = 300.0) -> "DraftLink":
        link = cls(comm, comm.Get_size() - 1, None, spec.draft_timeout_s)
        try:
            link._handshake(spec, runtime, vocab_size, draft_model, max_seq_len, start_timeout_s)
        except ValueError:
            link.close()  # the draft rank is up: shut it down, then report
            raise
        return link

    def _handshake(self, spec, runtime, vocab_size, draft_model, max_seq_len, timeout_s) -> None:
        """Start the draft rank serving, and take its round buffers: the POSIX segment `spawn`
        made, else an MPI window (host) or the draft's CUDA IPC buffers, mapped once Ready."""
        layout = self.buffers.layout if self.buffers is not None else _layout(runtime, spec, vocab_size)
        self.channel.poll_interval_s = runtime.poll_interval_s
        # The draft blocks on its doorbell between messages; each message to it rings it.
        self.channel.ringer = Doorbell.ringer()
        self.channel.send(P.Hello(spec, runtime, layout, draft_model, max_seq_len, self.channel.ringer.name),
                          P.CONTROL_TAG)
        cuda_ipc = layout.transport == Transport.CUDA_IPC.value
        if self.buffers is None and not cuda_ipc:
            self.buffers = SharedBuffers.create_window(self.comm, layout)  # collective with the draft rank
        try:
            ready = self._recv(timeout_s)
        except PeerLost as err:
            raise RuntimeError(f"draft rank did not start: {err}") from err
        if not isinstance(ready, P.Ready):
            raise RuntimeError(f"draft rank did not start: {ready}")
        if ready.vocab_size != layout.vocab_size:
            raise ValueError(f"draft vocab_size {ready.vocab_size} != target vocab_size {layout.vocab_size}")
        if cuda_ipc:
            self.buffers = CudaIpcBuffers.attach(layout, ready.buffers)  # mapped once, for the link's life
        self.pid = ready.pid
        self._started = start_time(ready.pid)
        self.step_s = ready.step_s
        log.info("draft rank ready, pid %d (model loaded in %.1f s)", ready.pid, ready.load_time_s)

    # --- messages ----------------------------------------------------------------------------

    def _process_alive(self) -> bool:
        if self.job is not None:
            return self.job.running()
        # A rank of our own job (launch "world", one host): its pid, unless not known yet.
        return self._started is None or start_time(self.pid) == self._started

    def _recv(self, timeout_s: float | None = None) -> object:
        msg = self.channel.recv(P.REPLY_TAG, timeout_s or self.timeout_s, self._process_alive)
        if isinstance(msg, P.DraftError):
            raise PeerLost(f"draft rank error: {msg.message}")
        return msg

    def send(self, msg: object) -> bool:
        if not self.alive:
            return False
        if not self._process_alive():
            self.mark_dead("draft process exited")
            return False
        self.channel.send(msg, P.CONTROL_TAG)
        return True

    def speculate(self, req: P.SpeculateRequest) -> tuple[P.SpeculateReply, torch.Tensor, torch.Tensor | None]:
        """Send the outcomes, wait for the speculation. Raises PeerLost (link then dead)."""
        if not self.send(req):
            raise PeerLost(self.failure or "draft unavailable")
        try:
            reply = self._recv()
        except PeerLost as err:
            self.mark_dead(str(err))
            raise
        # On the host: the target's verification math runs there (its executor returns host logits).
        tokens, probs = self.buffers.receive(reply.buffer, len(req.outcomes), reply.has_probs, HOST)
        return reply, tokens, probs

    def mark_dead(self, reason: str) -> None:
        _mark_lost(self, "draft rank", reason)
        if self.job is not None:
            # A draft that stopped answering must not come back mid-stream; one that is stopped
            # or hung would hold its processes and shared memory forever.
            _end_job(self.job)

    # --- stop --------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the draft down and free what we created (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.alive:
            with contextlib.suppress(Exception):  # shutting down anyway
                self.channel.send(P.Shutdown(), P.CONTROL_TAG)
        if self.job is not None:
            # The MPI connection is only taken down with a draft that exited cleanly: with a
            # dead peer, Disconnect could wait forever.
            if self.alive and self.job.wait(EXIT_GRACE_S) == 0:
                self.comm.Free()
                self._inter.Disconnect()
            _end_job(self.job)  # nothing left to kill after a clean exit; otherwise kill and clean up
        if self.buffers is not None:
            if self.job is not None or self.alive:
                self.buffers.close()
            self.buffers = None
        if self.channel.ringer is not None:
            self.channel.ringer.close()
        self.alive = False


def _layout(runtime: RuntimeConfig, spec: SpeculativeConfig, vocab_size: int) -> P.BufferLayout:
    """The round buffers' layout when no POSIX segment names them (an MPI window, or CUDA IPC)."""
    transport = runtime.resolved_transport
    device = runtime.draft_device if transport is Transport.CUDA_IPC else "cpu"
    return P.BufferLayout(runtime.max_batch, spec.k, vocab_size, None, transport.value, device)


def _accept(port: str, job: ProcessTree, timeout_s: float) -> MPI.Intercomm:
    """Accept the draft's connection; fail clearly if it exits or takes too long."""
    result: dict = {}
    mpi = require_mpi("launch='spawn'")

    def accept() -> None:
        try:
            result["comm"] = mpi.COMM_SELF.Accept(port)
        except Exception as err:  # noqa: BLE001 - reported below
            result["error"] = err

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    failure = None
    while thread.is_alive() and failure is None:
        thread.join(0.05)
        if not job.running() and thread.is_alive():
            failure = f"draft rank exited with code {job.process.returncode} before connecting"
        elif time.monotonic() > deadline:
            failure = f"draft rank did not connect within {timeout_s:.0f} s"
    if failure is None and "error" not in result:
        return result["comm"]
    _end_job(job)  # nothing of that job may connect from here on
    if thread.is_alive():
        _release_accept(port, thread)
    mpi.Close_port(port)
    raise RuntimeError(failure or f"draft rank connection failed: {result['error']}")


def _release_accept(port: str, thread: threading.Thread) -> None:
    """End an MPI_Comm_accept that no draft will answer by connecting to it from a throwaway
    process: MPI has no way to cancel it, and a thread left inside it makes this process's
    MPI_Finalize abort at exit (leaving its own MPICH segment behind)."""
    code = "import sys; from mpi4py import MPI; MPI.COMM_SELF.Connect(sys.argv[1]).Disconnect()"
    try:
        subprocess.run([_mpiexec(), "-n", "1", sys.executable, "-c", code, port], stdin=subprocess.DEVNULL,
                       timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("could not release the pending MPI accept (%s): MPI_Finalize may fail at exit", err)
        return
    thread.join()
