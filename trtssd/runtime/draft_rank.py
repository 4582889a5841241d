"""The draft rank: a loop serving the target's messages (run as its own MPI process).

Started by the target (``python -m trtssd.runtime.draft_rank --port PORT`` under its own
``mpiexec -n 1``, connecting back through an MPI port) or as the last rank of
``mpiexec -n 2 ...`` (see `trtssd.runtime.launch`).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from mpi4py import MPI

from trtssd.config import Mode, batch_tokens
from trtssd.runtime import protocol as P
from trtssd.runtime.affinity import pin
from trtssd.runtime.draft_worker import DraftWorker
from trtssd.runtime.transport import Channel, SharedBuffers

log = logging.getLogger(__name__)


def serve(comm: MPI.Intracomm, target_rank: int = 0) -> None:
    """Serve until Shutdown. ``comm`` holds the target (``target_rank``) and this rank."""
    from trtssd.backends.loading import load_executor

    channel = Channel(comm, target_rank)
    hello: P.Hello = channel.recv(P.CONTROL_TAG)
    channel.poll_interval_s = hello.runtime.poll_interval_s
    pin("draft", hello.runtime.draft_cores, hello.runtime.draft_threads)
    if hello.layout.shm_name is None:
        buffers = SharedBuffers.create_window(comm, hello.layout)
    else:
        buffers = SharedBuffers.attach_posix(hello.layout)
    t0 = time.perf_counter()
    executor = load_executor(hello.draft_model, max_seqs=hello.runtime.max_batch, max_seq_len=hello.max_seq_len,
                             max_batch_tokens=batch_tokens(hello.spec, hello.runtime))
    worker = DraftWorker(executor, hello.spec)
    if hello.spec.mode is Mode.SSD and hello.spec.fixed_fanout is None:
        try:
            worker.calibrate()  # the auto fan-out needs to know what wider trees cost here
        except Exception:  # noqa: BLE001 - an optimisation: serve with the uncalibrated prior
            log.exception("draft forward calibration failed; the auto fan-out starts from a linear prior")
    channel.send(P.Ready(executor.vocab_size, time.perf_counter() - t0, os.getpid()), P.REPLY_TAG)
    try:
        _loop(channel, buffers, worker, hello.spec.mode is Mode.SSD)
    except Exception as err:  # report, so the target degrades instead of waiting for a timeout
        log.exception("draft rank failed")
        channel.send(P.DraftError(f"{type(err).__name__}: {err}"), P.REPLY_TAG)
    finally:
        buffers.close()


def _loop(channel: Channel, buffers: SharedBuffers, worker: DraftWorker, prespeculate: bool) -> None:
    prespec_s, branches = 0.0, 0
    while True:
        msg = channel.recv(P.CONTROL_TAG)
        if isinstance(msg, P.Shutdown):
            return
        if isinstance(msg, P.Prefill):
            worker.prefill(msg)
        elif isinstance(msg, P.Release):
            worker.release(msg.seq_ids)
        elif isinstance(msg, P.SpeculateRequest):
            t0 = time.perf_counter()
            ans = worker.answer(msg)
            rows = len(msg.outcomes)
            buffers.tokens(msg.buffer)[:rows].copy_(ans.tokens)
            if ans.probs is not None:
                buffers.probs(msg.buffer)[:rows].copy_(ans.probs)
            reply = P.SpeculateReply(
                round_id=msg.round_id,
                buffer=msg.buffer,
                hit=tuple(ans.hit),
                backup=tuple(ans.backup),
                point_mass=tuple(ans.point_mass),
                has_probs=ans.probs is not None,
                answer_time_s=time.perf_counter() - t0,
                prespec_time_s=prespec_s,
                tree_branches=branches,
            )
            channel.send(reply, P.REPLY_TAG)
            prespec_s = 0.0
            if prespeculate:
                t1 = time.perf_counter()
                branches = worker.prespeculate()
                prespec_s = time.perf_counter() - t1
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="trtssd draft rank (started by the target)")
    parser.add_argument("--port", required=True, help="MPI port name opened by the target")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s draft %(levelname)s %(message)s")
    inter = MPI.COMM_SELF.Connect(args.port)
    comm = inter.Merge(high=True)
    serve(comm, target_rank=0)
    comm.Free()
    inter.Disconnect()


if __name__ == "__main__":
    main()
