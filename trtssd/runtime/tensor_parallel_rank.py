"""A follower rank of a tensor-parallel target: its shard, making rank 0's calls (run as a process).

Started by rank 0 (`trtssd.runtime.tensor_parallel.start_tensor_parallel_target`) as
``python -m trtssd.runtime.tensor_parallel_rank --rank R --size T --store-port P --leader-pid PID
--device D``, or run by ranks 1..T-1 of an ``mpiexec -n T+1`` job (`serve_in_world`, launch
"world"; trtssd/runtime/world.py), which learn the same from rank 0 over their communicator.
It joins the group through rank 0's store, loads the shard ``ShardSetup`` names, and replays each
`Mirror` message until told to shut down; the module docstring of trtssd/runtime/tensor_parallel.py
says why and how. It exits when rank 0 is gone (a failed wait on the closed connection, or
`exit_with`) and on any error that could leave its KV unlike rank 0's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from trtssd.backends.torch_backend import TorchExecutor
from trtssd.runtime import tensor_parallel as tp
from trtssd.runtime.core_lending import pin
from trtssd.runtime.processes import exit_with

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger(__name__)


def serve(rank: int, size: int, store: dist.Store, device: str) -> None:
    """``device``: rank 0's; this rank's follows from it (`rank_device`)."""
    store.set(tp.JOINED_KEY.format(rank=rank), str(os.getpid()))
    control = tp.join_group(store, rank, size, tp.rank_device(device, rank))
    setup: tp.ShardSetup = tp.receive(control)
    executor = _load(setup, rank, size, control)
    if executor is not None:
        _replay(executor, control)


def _load(setup: tp.ShardSetup, rank: int, size: int, control: dist.ProcessGroup) -> TorchExecutor | None:
    pin("target", setup.cores, setup.threads)
    t0 = time.perf_counter()
    executor, error = None, None
    try:
        executor = tp.load_shard(setup, rank, size)
    except Exception as err:  # noqa: BLE001 - reported to rank 0, which fails to start with it
        log.exception("loading the shard failed")
        error = f"{type(err).__name__}: {err}"
    tp.gather_ready(tp.RankReady(rank, os.getpid(), error, time.perf_counter() - t0), control)
    return executor


def _replay(executor: TorchExecutor, control: dist.ProcessGroup) -> None:
    while True:
        message: tp.Mirror = tp.receive(control)
        for name, args in message.calls:
            if name not in tp.MIRRORED_CALLS:
                raise TypeError(f"unexpected call {name!r} from rank 0")
            # Rank 0 made this call successfully on the same state: failing here means the ranks
            # differ, and the exception ends this rank (rank 0 then loses the group).
            tp.MIRRORED_CALLS[name](executor, *args)
        if message.chunks is not None:
            mine = tuple(executor.committed(c.seq_id) for c in message.chunks)
            if mine != message.committed:
                raise RuntimeError(f"this rank's sequences differ from rank 0's (committed tokens {mine}, rank 0 "
                                   f"{message.committed}): a call was lost")
            try:
                executor.forward(list(message.chunks))
            except tp.REQUEST_ERRORS as err:
                log.debug("forward refused on every rank: %s", err)  # rank 0 raised the same
        if message.shutdown:
            return


def serve_in_world(targets: MPI.Intracomm) -> None:
    """A follower rank of a launch "world" job: meet rank 0 (collective with its
    `_meet_world_followers` over ``targets``), then serve as a started follower does."""
    rendezvous: tp.WorldRendezvous = targets.bcast(None, root=0)
    targets.gather(os.getpid(), root=0)
    rank, size = targets.Get_rank(), targets.Get_size()
    _serve_until_done(rank, size, rendezvous.store_port, rendezvous.leader_pid, rendezvous.device)


def _serve_until_done(rank: int, size: int, store_port: int, leader_pid: int, device: str) -> None:
    exit_with(leader_pid, lambda: log.warning("rank 0 (pid %d) is gone: exiting", leader_pid))
    store = dist.TCPStore(tp.STORE_HOST, store_port, size, is_master=False,
                          timeout=timedelta(seconds=tp.START_TIMEOUT_S))
    try:
        serve(rank, size, store, device)
    except Exception:  # noqa: BLE001 - logged; rank 0 sees this rank exit
        log.exception("target rank %d failed", rank)
        os._exit(1)  # a clean exit could wait on peers that are gone
    tp.leave_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="trtssd tensor-parallel target rank (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True, help="rank 0's TCPStore port on the loopback")
    parser.add_argument("--leader-pid", type=int, required=True, help="rank 0's process: exit when it is gone")
    parser.add_argument("--device", default="cpu", help="rank 0's device: 'cpu' or 'cuda:N' (this rank: N + rank)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s target rank {args.rank} %(levelname)s %(message)s")
    _serve_until_done(args.rank, args.size, args.store_port, args.leader_pid, args.device)


if __name__ == "__main__":
    main()
    sys.exit(0)
