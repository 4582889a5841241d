"""The draft rank: its side of the protocol (`DraftServer`, free of any transport: one call per
message) and the loop serving the target's messages (run as its own MPI process, started as
draft_client.py says). The MPI loop here and the in-process `LocalDraft` both drive a
`DraftServer`, so the draft behaves the same behind either.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import TYPE_CHECKING

from trtssd.backends.loading import load_executor
from trtssd.config import Mode, ModelRef, RuntimeConfig, SpeculativeConfig, Transport, batch_tokens
from trtssd.cores import pin
from trtssd.devices import resolve_device
from trtssd.models.tokenizer import load_tokenizer
from trtssd.processes import SHM_DIR, exit_with, mapped_segments, remove_files
from trtssd.runtime import protocol as P
from trtssd.runtime.cuda_ipc import CudaIpcBuffers
from trtssd.runtime.draft_worker import DraftWorker
from trtssd.runtime.transport import (MPICH_SHM_PREFIXES, Channel, Doorbell, RoundBuffers, SharedBuffers,
                                      require_mpi)
from trtssd.structured.grammar import Grammars

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger(__name__)


CALIBRATION_MAX_ROWS = 64  # the widest draft forward timed at start-up (costs beyond it are extrapolated)


def load_worker(draft_model: ModelRef, spec: SpeculativeConfig, runtime: RuntimeConfig, max_seq_len: int) -> DraftWorker:
    """The draft model and its worker, calibrated for the auto fan-out and for load control."""
    executor = load_executor(draft_model, max_seqs=runtime.max_batch, max_seq_len=max_seq_len,
                             max_batch_tokens=batch_tokens(spec, runtime), device=runtime.draft_device,
                             device_field="draft_device", row_invariant=False,
                             kept_prompts=runtime.kept_sequences)
    # The tokenizer is loaded at the first constrained request, not before.
    grammars = Grammars(lambda: load_tokenizer(draft_model.path), executor.vocab_size)
    worker = DraftWorker(executor, spec, prefix_cache_seqs=runtime.prefix_cache_seqs, grammars=grammars,
                          prefix_cache_mib=runtime.prefix_cache_mib)
    # The auto fan-out prices trees with it; load control bounds what speculation can give with it.
    if (spec.mode is Mode.SSD and spec.fixed_fanout is None) or spec.plain_under_load:
        # No wider than this configuration's widest tree or glue: the widest sizes cost the most
        # (seconds of start-up), and measurements beyond them would never be used.
        widest = runtime.max_batch * max(spec.budget, spec.k + 1)
        try:
            worker.calibrate(max_rows=min(CALIBRATION_MAX_ROWS, widest))  # what wider trees cost here
        except Exception:  # noqa: BLE001 - an optimisation: serve with the uncalibrated prior
            log.exception("draft forward calibration failed; the auto fan-out starts from a linear prior, load control "
                          "without a ceiling")
    return worker


class DraftServer:
    def __init__(self, worker: DraftWorker, buffers: RoundBuffers):
        self.worker = worker
        self.buffers = buffers
        self._prespec_s = 0.0  # pre-speculation time since the last reply, reported with the next
        self._branches = 0

    def handle(self, msg: object) -> P.SpeculateReply | None:
        """Apply one control message; a SpeculateRequest gets a reply (its rows in the buffer)."""
        if isinstance(msg, P.Prefill):
            self.worker.prefill(msg)
        elif isinstance(msg, P.Release):
            self.worker.release(msg.seq_ids)
        elif isinstance(msg, P.SpeculateRequest):
            return self._speculate(msg)
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")
        return None

    def _speculate(self, req: P.SpeculateRequest) -> P.SpeculateReply:
        t0 = time.perf_counter()
        ans = self.worker.answer(req)
        rows = len(req.outcomes)
        self.buffers.tokens(req.buffer)[:rows].copy_(ans.tokens)
        if ans.probs is not None:
            self.buffers.probs(req.buffer)[:rows].copy_(ans.probs)
        self.buffers.publish(req.buffer)  # before the reply: the target reads once it has the reply
        reply = P.SpeculateReply(
            round_id=req.round_id,
            buffer=req.buffer,
            sources=tuple(ans.sources),
            point_mass=tuple(ans.point_mass),
            has_probs=ans.probs is not None,
            answer_time_s=time.perf_counter() - t0,
            prespec_time_s=self._prespec_s,
            tree_branches=self._branches,
            cached_tokens=tuple(ans.cached_tokens),
        )
        self._prespec_s, self._branches = 0.0, 0
        return reply

    def after_reply(self) -> None:
        """SSD: pre-speculate for the next round while the target verifies this one."""
        if self.worker.spec.mode is Mode.SSD:
            t0 = time.perf_counter()
            self._branches = self.worker.prespeculate()
            self._prespec_s = time.perf_counter() - t0

    def when_idle(self) -> None:
        """SSD, with no message waiting: pre-speculate the first round of sequences just
        prefilled, while the target still prefills them."""
        if self.worker.spec.mode is Mode.SSD:
            t0 = time.perf_counter()
            if self.worker.prespeculate_first_tokens():
                self._prespec_s += time.perf_counter() - t0


def end_with_target(target_pid: int) -> None:
    """Called in the draft rank: exit as soon as the target process is gone.

    A target that ends without shutting the draft down (killed, or exiting without close())
    would otherwise leave the draft job waiting for messages forever. MPI_Finalize cannot run
    then (the rank is connected to a dead process), so the rank removes the MPICH segments it
    maps, as MPI_Finalize would have, and those the target mapped: a killed target never
    reached its own MPI_Finalize (after a normal exit they are gone already). The target's
    resource tracker removes our buffers.
    """
    target_segments = mapped_segments(target_pid, MPICH_SHM_PREFIXES)  # the target is alive: it started us

    def before_exit() -> None:
        log.warning("target process %d exited without shutting the draft down: exiting", target_pid)
        remove_files(SHM_DIR + name for name in mapped_segments(os.getpid(), MPICH_SHM_PREFIXES) | target_segments)

    exit_with(target_pid, before_exit)


def serve(comm: MPI.Intracomm, target_rank: int = 0) -> None:
    """Serve until Shutdown. ``comm`` holds the target (``target_rank``) and this rank."""
    channel = Channel(comm, target_rank)
    hello: P.Hello = channel.recv(P.CONTROL_TAG)
    channel.poll_interval_s = hello.runtime.poll_interval_s
    # Rings before this are dropped: the one message before Ready is this Hello, polled for.
    channel.doorbell = Doorbell.listen(hello.doorbell) if hello.doorbell else None
    pin("draft", hello.runtime.draft_cores, hello.runtime.draft_threads)
    buffers = None
    try:
        buffers = _open_buffers(comm, hello.layout)
        t0 = time.perf_counter()
        worker = load_worker(hello.draft_model, hello.spec, hello.runtime, hello.max_seq_len)
        handles = buffers.export() if isinstance(buffers, CudaIpcBuffers) else None
        channel.send(P.Ready(worker.executor.vocab_size, time.perf_counter() - t0, os.getpid(), handles,
                             worker.calibrated_step_s), P.REPLY_TAG)
        _loop(channel, DraftServer(worker, buffers))
    except Exception as err:
        # Report, so the target degrades (or, before Ready, fails to start with this message)
        # at once instead of waiting for a timeout; the target then ends this job.
        log.exception("draft rank failed")
        channel.send(P.DraftError(f"{type(err).__name__}: {err}"), P.REPLY_TAG)
    finally:
        if buffers is not None:
            buffers.close()
        if channel.doorbell is not None:
            channel.doorbell.close()


def _open_buffers(comm: MPI.Intracomm, layout: P.BufferLayout) -> RoundBuffers:
    """This side of the round buffers the target chose: the draft allocates CUDA IPC buffers on
    its own device (the target maps them after Ready); host ones are the target's window or
    POSIX segment (the window is collective: the target creates it right after Hello)."""
    if layout.transport == Transport.CUDA_IPC.value:
        return CudaIpcBuffers.create(layout, resolve_device(layout.device, "draft_device"))
    if layout.shm_name is None:
        return SharedBuffers.create_window(comm, layout)
    return SharedBuffers.attach_posix(layout)


def _loop(channel: Channel, server: DraftServer) -> None:
    while True:
        msg = channel.recv(P.CONTROL_TAG)
        if isinstance(msg, P.Shutdown):
            return
        reply = server.handle(msg)
        if reply is not None:
            channel.send(reply, P.REPLY_TAG)
            server.after_reply()  # overlaps the target's verification
        if not channel.poll(P.CONTROL_TAG):
            server.when_idle()  # overlaps the target's prefill of new sequences


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="trtssd draft rank (started by the target)")
    parser.add_argument("--port", required=True, help="MPI port name opened by the target")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--target-pid", type=int, help="the target process: exit when it is gone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s draft %(levelname)s %(message)s")
    if args.target_pid is not None:
        end_with_target(args.target_pid)  # a target killed before it could shut us down
    inter = require_mpi("the draft rank").COMM_SELF.Connect(args.port)
    comm = inter.Merge(high=True)
    serve(comm, target_rank=0)
    comm.Free()
    inter.Disconnect()


if __name__ == "__main__":
    main()
