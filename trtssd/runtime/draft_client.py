"""What the target loop needs from a draft rank, and an in-process draft behind the same calls.

`DraftLink` (trtssd.runtime.draft_link) is the real one: a separate MPI process. `LocalDraft` runs
the same `DraftServer` and `DraftWorker` in this process, synchronously: the target loop's tests
use it without MPI, and it serves single-process debugging. It pre-speculates right after
answering instead of during the verification, and a new sequence's first round just before
answering it instead of during the target's prefill, which changes timing, never tokens.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

import torch

from trtssd.runtime import protocol as P
from trtssd.runtime.draft_server import DraftServer
from trtssd.runtime.draft_worker import DraftWorker
from trtssd.runtime.transport import PeerLost, SharedBuffers

log = logging.getLogger(__name__)


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
        tokens, probs = self.server.buffers.receive(reply.buffer, len(req.outcomes), reply.has_probs,
                                                    torch.device("cpu"))
        return reply, tokens, probs

    def mark_dead(self, reason: str) -> None:
        if self.alive:
            log.warning("draft lost (%s): continuing in ar mode", reason)
        self.alive = False
        self.failure = reason

    def close(self) -> None:
        self.alive = False
