"""Moving messages and tensors between the ranks.

- `Channel`: small control messages over MPI. Waiting polls with `Iprobe` and sleeps between
  polls, because a blocking MPI receive busy-polls a whole core (on a 2-core machine that is
  the core the other rank computes on).
- `SharedBuffers`: the bulk rows (proposal tokens [B, K] and q' rows [B, K, V]) in real shared
  memory, two buffers so the draft can write round t+1 while the target still reads round t.
  Backed by an MPI-3 shared-memory window when both ranks share one MPI job (``mpiexec -n 2``),
  or by POSIX shared memory when the draft is its own MPI job connected through an MPI port
  (the API's launch mode: MPICH kills every rank of a job when one dies, so a separate job is
  what lets the target survive its draft).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable

import torch
from mpi4py import MPI

from trtssd.runtime.protocol import BufferLayout

log = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """The other rank died or did not answer in time."""


class Channel:
    """Pickled control messages to one peer rank of an intracommunicator."""

    def __init__(self, comm: MPI.Intracomm, peer: int, poll_interval_s: float = 0.0002):
        self.comm = comm
        self.peer = peer
        self.poll_interval_s = poll_interval_s

    def send(self, msg: object, tag: int) -> None:
        self.comm.send(msg, dest=self.peer, tag=tag)

    def poll(self, tag: int) -> bool:
        return self.comm.iprobe(source=self.peer, tag=tag)

    def recv(
        self, tag: int, timeout_s: float | None = None, alive: Callable[[], bool] = lambda: True
    ) -> object:
        """Wait for a message without spinning; PeerLost on timeout or when ``alive()`` turns
        False (checked between polls, so a dead peer is noticed within a poll interval)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        spins = 0
        while not self.comm.iprobe(source=self.peer, tag=tag):
            if deadline is not None and time.monotonic() > deadline:
                raise PeerLost(f"no message from rank {self.peer} within {timeout_s:.1f} s")
            spins += 1
            if spins % 64 == 0 and not alive():
                raise PeerLost(f"rank {self.peer} exited")
            # A short spin first keeps the hand-off latency low when the answer is imminent.
            if spins > 20:
                time.sleep(self.poll_interval_s)
        return self.comm.recv(source=self.peer, tag=tag)


def _buffer_bytes(layout: BufferLayout) -> int:
    return layout.max_batch * layout.k * (8 + 4 * layout.vocab_size)


class SharedBuffers:
    """Two buffers of [tokens int64 [B, K] | probs fp32 [B, K, V]] in shared memory."""

    def __init__(self, layout: BufferLayout, buffer, owner_cleanup: Callable[[], None]):
        self.layout = layout
        self._buffer = buffer
        self._cleanup = owner_cleanup
        B, K, V = layout.max_batch, layout.k, layout.vocab_size
        size = _buffer_bytes(layout)
        self._tokens = []
        self._probs = []
        for index in range(2):
            base = index * size
            self._tokens.append(torch.frombuffer(buffer, dtype=torch.int64, count=B * K, offset=base).view(B, K))
            self._probs.append(
                torch.frombuffer(buffer, dtype=torch.float32, count=B * K * V, offset=base + B * K * 8).view(B, K, V)
            )

    @staticmethod
    def nbytes(layout: BufferLayout) -> int:
        return 2 * _buffer_bytes(layout)

    def tokens(self, buffer: int) -> torch.Tensor:
        return self._tokens[buffer]

    def probs(self, buffer: int) -> torch.Tensor:
        return self._probs[buffer]

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
        layout = BufferLayout(max_batch, k, vocab_size, name)
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
        win = MPI.Win.Allocate_shared(size, 1, comm=comm)
        buf, _ = win.Shared_query(0)
        return cls(layout, memoryview(buf).cast("B"), win.Free)
