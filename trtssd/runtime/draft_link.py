"""The target's handle on the draft rank: start it, talk to it, notice when it is gone.

Two ways to get a draft rank:
- `DraftLink.spawn`: the Python API starts the draft as its own one-process MPI job and accepts
  its connection on an MPI port (MPI dynamic process management), so a user never calls mpiexec.
  MPICH ends every process of a job when one dies (``MPI_Comm_spawn`` children included), so a
  separate job is what lets the target outlive a dead draft. Bulk rows use POSIX shared memory.
- `DraftLink.from_world`: under ``mpiexec -n 2``, the last rank of COMM_WORLD is the draft and
  the bulk rows use an MPI-3 shared-memory window. A dying rank there takes the job down (MPICH
  has no fault tolerance); timeouts still degrade to AR.

Any failure (timeout, exit, DraftError) marks the link dead; the engine then decodes in AR mode
from its own state, so nothing is lost.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from mpi4py import MPI

from trtssd.config import ModelRef, RuntimeConfig, SpeculativeConfig
from trtssd.runtime import protocol as P
from trtssd.runtime.transport import Channel, PeerLost, SharedBuffers

log = logging.getLogger(__name__)


def _mpiexec() -> str:
    """The mpiexec next to this interpreter (the mpich wheel's), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: install the 'mpich' wheel (pip install mpich)")
    return found


class DraftLink:
    def __init__(self, comm: MPI.Intracomm, peer: int, process: subprocess.Popen | None, timeout_s: float):
        self.comm = comm
        self.channel = Channel(comm, peer)
        self.process = process
        self.timeout_s = timeout_s
        self.buffers: SharedBuffers | None = None
        self.alive = True
        self.failure: str | None = None
        self.pid: int | None = None

    # --- start -------------------------------------------------------------------------------

    @classmethod
    def spawn(cls, draft_model: ModelRef, spec: SpeculativeConfig, runtime: RuntimeConfig, vocab_size: int,
              max_seq_len: int, start_timeout_s: float = 300.0) -> "DraftLink":
        port = MPI.Open_port()
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        level = logging.getLevelName(logging.getLogger("trtssd").getEffectiveLevel())
        cmd = [_mpiexec(), "-n", "1", sys.executable, "-m", "trtssd.runtime.draft_rank",
               "--port", port, "--log-level", str(level)]
        process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        inter = _accept(port, process, start_timeout_s)
        MPI.Close_port(port)
        comm = inter.Merge(high=False)
        link = cls(comm, 1, process, spec.draft_timeout_s)
        link._inter = inter
        buffers = SharedBuffers.create_posix(runtime.max_batch, spec.k, vocab_size)
        link._handshake(spec, runtime, buffers.layout, draft_model, max_seq_len, start_timeout_s, buffers)
        return link

    @classmethod
    def from_world(cls, comm: MPI.Intracomm, draft_model: ModelRef, spec: SpeculativeConfig, runtime: RuntimeConfig,
                   vocab_size: int, max_seq_len: int, start_timeout_s: float = 300.0) -> "DraftLink":
        link = cls(comm, comm.Get_size() - 1, None, spec.draft_timeout_s)
        layout = P.BufferLayout(runtime.max_batch, spec.k, vocab_size, None)
        link._handshake(spec, runtime, layout, draft_model, max_seq_len, start_timeout_s, None)
        return link

    def _handshake(self, spec, runtime, layout, draft_model, max_seq_len, timeout_s, buffers) -> None:
        self.channel.poll_interval_s = runtime.poll_interval_s
        self.channel.send(P.Hello(spec, runtime, layout, draft_model, max_seq_len), P.CONTROL_TAG)
        self.buffers = buffers if buffers is not None else SharedBuffers.create_window(self.comm, layout)
        ready = self._recv(timeout_s)
        if not isinstance(ready, P.Ready):
            raise RuntimeError(f"draft rank did not start: {ready}")
        if ready.vocab_size != layout.vocab_size:
            self.close()
            raise ValueError(f"draft vocab_size {ready.vocab_size} != target vocab_size {layout.vocab_size}")
        self.pid = ready.pid
        log.info("draft rank ready, pid %d (model loaded in %.1f s)", ready.pid, ready.load_time_s)

    # --- messages ----------------------------------------------------------------------------

    def _process_alive(self) -> bool:
        return self.process is None or self.process.poll() is None

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
        rows = len(req.outcomes)
        tokens = self.buffers.tokens(reply.buffer)[:rows]
        probs = self.buffers.probs(reply.buffer)[:rows] if reply.has_probs else None
        return reply, tokens, probs

    def mark_dead(self, reason: str) -> None:
        if self.alive:
            log.warning("draft rank lost (%s): continuing in ar mode", reason)
        self.alive = False
        self.failure = reason
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # a draft that stopped answering must not come back mid-stream

    # --- stop --------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the draft down and free what we created (idempotent)."""
        if self.alive:
            try:
                self.channel.send(P.Shutdown(), P.CONTROL_TAG)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        if self.buffers is not None:
            if self.process is not None or self.alive:
                self.buffers.close()
            self.buffers = None
        if self.process is not None:
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            if self.alive:
                self.comm.Free()
                self._inter.Disconnect()
        self.alive = False


def _accept(port: str, process: subprocess.Popen, timeout_s: float) -> MPI.Intercomm:
    """Accept the draft's connection; fail clearly if it exits or takes too long."""
    result: dict = {}

    def accept() -> None:
        try:
            result["comm"] = MPI.COMM_SELF.Accept(port)
        except Exception as err:  # noqa: BLE001 - reported below
            result["error"] = err

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(0.05)
        if process.poll() is not None and thread.is_alive():
            raise RuntimeError(f"draft rank exited with code {process.returncode} before connecting")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"draft rank did not connect within {timeout_s:.0f} s")
    if "error" in result:
        raise RuntimeError(f"draft rank connection failed: {result['error']}")
    return result["comm"]
