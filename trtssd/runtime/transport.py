"""Moving messages and tensors between the ranks.

- `Channel`: small control messages over MPI. Waiting polls with `Iprobe` and sleeps between
  polls, because a blocking MPI receive busy-polls a whole core (on a 2-core machine that is
  the core the other rank computes on); the draft's channel blocks on a `Doorbell` instead, so
  an idle draft takes no cycles from the cores plain rounds borrow (runtime/core_lending.py).
- `RoundBuffers`: the bulk rows of a round, in two buffers so the draft can write round t+1 while
  the target still reads round t: `SharedBuffers` (here) in shared host memory, an MPI-3 window
  when both ranks are one MPI job, else POSIX shared memory (the draft its own MPI job:
  draft_client.py); or `CudaIpcBuffers` (cuda_ipc.py) on the draft's GPU, mapped by the target
  once at start-up (unverified: never run on a GPU).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import sys
import time
import uuid
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from trtssd.config import Transport
from trtssd.runtime.protocol import BufferLayout

if TYPE_CHECKING:  # the real module only through require_mpi: importing it runs MPI_Init
    from mpi4py import MPI

log = logging.getLogger(__name__)

MAX_POLL_INTERVAL_S = 0.005  # the longest sleep between polls of a long wait
SPIN_POLLS = 20  # polls without sleeping at the start of a wait, when the answer is imminent
RING_POLL_S = 0.05  # after a ring, poll this long: its message may still be on its way
BLOCK_TIMEOUT_S = 1.0  # the longest a doorbell wait blocks before ``alive`` and the deadline are checked
MPICH_SHM_PREFIXES = ("mpich_",)  # MPICH's shared memory under /dev/shm (MPI_Init makes it, MPI_Finalize removes it)


def require_mpi(what: str):
    """The mpi4py MPI module, or a clear error saying what needed it.

    Imported here, by the launches that talk MPI ("spawn", "world", the draft rank), never at
    module import: importing it runs MPI_Init, and MPICH's MPI_Init creates a /dev/shm segment
    that only MPI_Finalize removes, so a killed launch="local" process (no MPI needed, mpi4py
    optional) would leave it behind. mpi4py's defaults stay as they were: THREAD_MULTIPLE (a
    pending MPI accept runs on its own thread, draft_client.DraftLink) and MPI_Finalize at exit; and a user
    script's own ``from mpi4py import MPI`` still initialises MPI as it always did.
    """
    try:
        from mpi4py import MPI
    except ImportError as err:  # e.g. a GPU machine with torch and triton alone
        raise RuntimeError(f"{what} needs mpi4py and an MPI library (pip install mpi4py mpich); "
                           "launch='local' runs the draft in this process without them") from err
    return MPI


class PeerLost(RuntimeError):
    """The other rank died or did not answer in time."""


class Doorbell:
    """A wake-up beside MPI: a datagram socket in Linux's abstract namespace (no file, so nothing
    is left behind by a killed rank). The receiving rank binds it (`listen`) and blocks on it while
    it waits for a message; the sending rank rings it (`ring`) after each message it sends.

    A ring is a hint: one to a rank that is gone or not yet listening is dropped, and a waiter
    drains every ring before it probes MPI, so a ring can wake it early (it polls a little, then
    blocks again) but a message is never missed (`Channel.recv`)."""

    def __init__(self, name: str, sock: socket.socket):
        self.name = name
        self._sock = sock

    @classmethod
    def listen(cls, name: str) -> "Doorbell | None":
        """The receiving end, or None where abstract sockets are unavailable (the rank then polls)."""
        if not sys.platform.startswith("linux"):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind("\0" + name)
        except OSError as err:
            sock.close()
            log.warning("no doorbell %r (%s): waiting for messages by polling", name, err)
            return None
        sock.setblocking(False)
        return cls(name, sock)

    @classmethod
    def ringer(cls) -> "Doorbell":
        """The sending end of a new doorbell, which the other rank listens on once told its ``name``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        return cls(f"trtssd-wake-{os.getpid()}-{uuid.uuid4().hex[:16]}", sock)

    def ring(self) -> None:
        try:
            self._sock.sendto(b"\0", "\0" + self.name)
        except OSError:  # no listener (not yet, or gone) or a full queue: a waiter is awake already
            pass

    def wait(self, timeout_s: float) -> bool:
        """Block until a ring (True, every pending ring drained) or ``timeout_s`` (False)."""
        readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout_s))
        if not readable:
            return False
        while True:
            try:
                self._sock.recv(64)
            except BlockingIOError:
                return True

    def close(self) -> None:
        self._sock.close()


class Channel:
    """Pickled control messages to one peer rank of an intracommunicator.

    ``ringer``: the peer's doorbell, rung after every message sent. ``doorbell``: this rank's own,
    which `recv` blocks on instead of polling."""

    def __init__(self, comm: MPI.Intracomm, peer: int, poll_interval_s: float = 0.0002):
        self.comm = comm
        self.peer = peer
        self.poll_interval_s = poll_interval_s
        self.ringer: Doorbell | None = None
        self.doorbell: Doorbell | None = None
        self._rung_at = float("-inf")  # when the doorbell last woke this rank

    def send(self, msg: object, tag: int) -> None:
        if self.ringer is None:
            self.comm.send(msg, dest=self.peer, tag=tag)
            return
        # Started, rung, then completed: a large message completes only once the receiver probes,
        # which a receiver blocked on its doorbell does after the ring.
        request = self.comm.isend(msg, dest=self.peer, tag=tag)
        self.ringer.ring()
        request.wait()

    def poll(self, tag: int) -> bool:
        return self.comm.iprobe(source=self.peer, tag=tag)

    def recv(
        self, tag: int, timeout_s: float | None = None, alive: Callable[[], bool] = lambda: True
    ) -> object:
        """Wait for a message without spinning; PeerLost on timeout or when ``alive()`` turns
        False (checked between polls, so a dead peer is noticed within a poll interval, or within
        ``BLOCK_TIMEOUT_S`` while blocked on the doorbell)."""
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        probes = 0
        polls = 0  # since the wait began, or since the last ring
        while not self.comm.iprobe(source=self.peer, tag=tag):
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise PeerLost(f"no message from rank {self.peer} within {timeout_s:.1f} s")
            probes += 1
            polls += 1
            if probes % 64 == 0 and not alive():
                raise PeerLost(f"rank {self.peer} exited")
            if polls <= SPIN_POLLS:
                continue  # the answer may be imminent
            if self.doorbell is not None and now - self._rung_at > RING_POLL_S:
                # Every ring is drained before the next probe, and the sender rings after each
                # message: a message is either probed next or announced by a ring still to come.
                wait_s = BLOCK_TIMEOUT_S if deadline is None else min(BLOCK_TIMEOUT_S, deadline - now)
                if self.doorbell.wait(wait_s):
                    self._rung_at, polls = time.monotonic(), 0
                elif not alive():
                    raise PeerLost(f"rank {self.peer} exited")
                continue
            # A long wait polls less often, since each wake-up takes a slice of a core the other
            # rank may be using (trtssd/runtime/core_lending.py): a message is noticed within a
            # fiftieth of the wait so far (since the last ring, after one).
            waited_s = now - max(start, self._rung_at)
            time.sleep(min(MAX_POLL_INTERVAL_S, max(self.poll_interval_s, waited_s / 50)))
        return self.comm.recv(source=self.peer, tag=tag)


class RoundBuffers(Protocol):
    """Two buffers of one round's rows, written by the draft rank and read by the target rank."""

    layout: BufferLayout

    def tokens(self, buffer: int) -> torch.Tensor:
        """The writer's view of buffer ``buffer``'s proposal tokens, int64 [B, K]."""

    def probs(self, buffer: int) -> torch.Tensor:
        """The writer's view of buffer ``buffer``'s q' rows, fp32 [B, K, V]."""

    def publish(self, buffer: int) -> None:
        """Writer: everything written into ``buffer`` so far is the round; call before replying."""

    def receive(self, buffer: int, rows: int, with_probs: bool,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reader, after the reply: the first ``rows`` rows of a published buffer on ``device``
        (tokens, probs or None). Valid until the reader's next request lets the writer reuse
        the buffer."""

    def close(self) -> None:
        """Release what this side created or mapped."""


class SharedBuffers:
    """`RoundBuffers` in shared host memory: two buffers of [tokens int64 [B, K] | probs fp32
    [B, K, V]]."""

    def __init__(self, layout: BufferLayout, buffer, owner_cleanup: Callable[[], None]):
        self.layout = layout
        self._buffer = buffer
        self._cleanup = owner_cleanup
        B, K, V = layout.max_batch, layout.k, layout.vocab_size
        bases = (0, self.nbytes(layout) // 2)
        self._tokens = [torch.frombuffer(buffer, dtype=torch.int64, count=B * K, offset=base).view(B, K)
                        for base in bases]
        self._probs = [torch.frombuffer(buffer, dtype=torch.float32, count=B * K * V, offset=base + B * K * 8)
                       .view(B, K, V) for base in bases]

    @staticmethod
    def nbytes(layout: BufferLayout) -> int:
        return 2 * layout.max_batch * layout.k * (8 + 4 * layout.vocab_size)

    def tokens(self, buffer: int) -> torch.Tensor:
        return self._tokens[buffer]

    def probs(self, buffer: int) -> torch.Tensor:
        return self._probs[buffer]

    def publish(self, buffer: int) -> None:
        """Nothing to do: the writes are plain stores to shared memory, and the MPI reply that
        follows them orders them before the target's reads."""

    def receive(self, buffer: int, rows: int, with_probs: bool,
                device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views of the rows when ``device`` is the host (no copy), else a copy there."""
        device = torch.device(device)
        tokens = self._tokens[buffer][:rows].to(device)
        probs = self._probs[buffer][:rows].to(device) if with_probs else None
        return tokens, probs

    def close(self) -> None:
        self._tokens.clear()
        self._probs.clear()
        self._buffer = None
        self._cleanup()

    # --- POSIX shared memory (draft in its own MPI job) -------------------------------------

    @classmethod
    def create_posix(cls, max_batch: int, k: int, vocab_size: int) -> "SharedBuffers":
        from multiprocessing import shared_memory

        name = f"trtssd-{uuid.uuid4().hex[:16]}"
        layout = BufferLayout(max_batch, k, vocab_size, name, Transport.HOST.value)
        shm = shared_memory.SharedMemory(name=name, create=True, size=cls.nbytes(layout))

        def cleanup() -> None:
            shm.close()
            shm.unlink()  # we created it, so we remove it

        return cls(layout, shm.buf, cleanup)

    @classmethod
    def attach_posix(cls, layout: BufferLayout) -> "SharedBuffers":
        from multiprocessing import resource_tracker, shared_memory

        shm = shared_memory.SharedMemory(name=layout.shm_name, create=False)
        # Attaching registers the segment with this process's resource tracker, which would
        # unlink it when we exit; the creator owns its lifetime.
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        return cls(layout, shm.buf, shm.close)

    # --- MPI-3 shared-memory window (both ranks in one MPI job) -----------------------------

    @classmethod
    def create_window(cls, comm: MPI.Intracomm, layout: BufferLayout) -> "SharedBuffers":
        """Collective over ``comm``: rank 0 allocates, every rank maps rank 0's memory."""
        size = cls.nbytes(layout) if comm.Get_rank() == 0 else 0
        win = require_mpi("an MPI-3 shared-memory window").Win.Allocate_shared(size, 1, comm=comm)
        buf, _ = win.Shared_query(0)
        return cls(layout, memoryview(buf).cast("B"), win.Free)
