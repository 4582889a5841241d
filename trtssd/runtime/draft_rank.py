"""The draft rank: a loop serving the target's messages (run as its own MPI process).

Started by the target (``python -m trtssd.runtime.draft_rank --port PORT`` under its own
``mpiexec -n 1``, connecting back through an MPI port) or as the last rank of
``mpiexec -n 2 ...`` (``LLM(launch="world")``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import TYPE_CHECKING

from trtssd.config import Transport
from trtssd.devices import resolve_device
from trtssd.runtime import protocol as P
from trtssd.runtime.core_lending import pin
from trtssd.runtime.cuda_ipc import CudaIpcBuffers
from trtssd.runtime.draft_server import DraftServer, load_worker
from trtssd.runtime.transport import Channel, Doorbell, RoundBuffers, SharedBuffers, require_mpi

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger(__name__)


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
        from trtssd.runtime.draft_link import end_with_target

        end_with_target(args.target_pid)  # a target killed before it could shut us down
    inter = require_mpi("the draft rank").COMM_SELF.Connect(args.port)
    comm = inter.Merge(high=True)
    serve(comm, target_rank=0)
    comm.Free()
    inter.Disconnect()


if __name__ == "__main__":
    main()
