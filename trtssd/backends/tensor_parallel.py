"""A tensor-parallel target on T processes: rank 0 leads, ranks 1..T-1 follow; one executor.

Rank 0 is the process that runs the target loop (``LLM``). Its executor is a
`TensorParallelExecutor`: the Executor protocol (trtssd/backends/base.py) over rank 0's own shard
of the model (trtssd/models/tensor_parallel.py), which sends every call that changes the KV state
to the followers, so the target loop is the T = 1 loop unchanged. Each follower (`serve`, run as
``python -m trtssd.backends.tensor_parallel``) holds its shard in an ordinary ``TorchExecutor``
(sized from the shard's local config: each rank caches only its own KV heads) and makes
the same calls in the same order, so every rank's sequence bookkeeping and KV stay identical; the
forwards meet in the shards' all-reduces and the head's all-gather, and every rank computes the
full logits (rank 0 verifies with its own; the followers drop theirs). Only rank 0 talks to the
draft, which stays one rank of its own as at T = 1.

How the calls travel. Bookkeeping calls (add_sequence, commit, release, share_prefix,
copy_slots) run on rank 0 first and are queued only when they succeeded, so a call rank 0 refuses
never reaches a follower; the queue goes out with the next forward, in one message (`Mirror`),
broadcast over a gloo group of its own (the *control* group): one message per forward, however
many rows a round commits. A forward is sent before rank 0 runs it: the ranks must run it
together. A forward that fails its checks (a ValueError or CapacityError, raised before any
collective) fails the same way on every rank, and followers go on. The model's collectives run
on the *compute* group (the default process group): gloo on CPU, NCCL on CUDA (written, not run:
rank r on device index base + r). Two groups because their waits differ: a follower waits for
its next call as long as the target idles (the control group's timeout is practically
unbounded, and gloo waits without spinning), while a collective inside a forward waits only for
a peer computing the same layer (`COLLECTIVE_TIMEOUT_S` bounds a stopped or hung rank).

How followers start, and why this way. ``LLM`` starts them itself as plain processes
(``python -m trtssd.backends.tensor_parallel``, each in a session of its own through
`ProcessTree`), for launch "spawn" and "local" alike; the ranks meet through a
torch.distributed TCPStore that rank 0 serves on the loopback. No MPI is involved: gloo and
NCCL need only the store, a follower then creates no MPICH shared-memory segment or hydra file
that a killed process would leave behind, and a dead follower cannot take rank 0 down with it,
as MPICH ends every process of an MPI job when one dies. Under ``mpiexec -n T+1`` (launch
"world") the followers are ranks 1..T-1 of that job instead (trtssd/runtime/world.py), and a
dead rank ends the whole job, as MPICH does.

Failures. A follower that exits (killed, crashed) is noticed before rank 0 sends a forward, or
inside one (gloo reports the closed connection at once); a stopped one after
`COLLECTIVE_TIMEOUT_S`. Either way the group is lost: rank 0 kills the remaining followers and
every later call raises `TensorParallelLost`, which ends the requests in flight with that error
(``LLM.generate`` raises it; a server fails its open streams with it). Nothing is left behind:
followers hold no shared memory, only sockets. A follower whose rank 0 is gone exits: its wait
for the next call fails on the closed connection, and `exit_with` watches rank 0's pid besides.
A lost draft is unaffected: the loop degrades to ar on the whole target group, as at T = 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from trtssd.backends.base import CapacityError, Chunk, chunk_on_host
from trtssd.backends.torch_backend import SUPPORTED_DTYPES, TorchExecutor
from trtssd.config import ModelRef, RuntimeConfig
from trtssd.cores import pin
from trtssd.devices import resolve_device
from trtssd.models.config import ModelConfig
from trtssd.models.engine_dir import is_engine_dir, load_manifest
from trtssd.models.loader import gguf_config, is_gguf, load_config, load_state_dict, read_gguf
from trtssd.models.tensor_parallel import check_tensor_parallel, tensor_parallel_model
from trtssd.processes import ProcessTree, exit_with, start_time

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger(__name__)


# --- a rank's executor: the ordinary TorchExecutor of its shard -------------------------------------


def tensor_parallel_executor(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    rank: int,
    size: int,
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **executor_options: Any,
) -> TorchExecutor:
    """Rank ``rank``'s executor of a ``size``-way split of the model (``cfg``, full fp32 ``state``
    in ``LlamaModel``'s layout). ``executor_options``: ``TorchExecutor``'s (max_seqs,
    max_seq_len, max_batch_tokens, memory_budget_bytes, ...), the same on every rank."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    model = tensor_parallel_model(cfg, state, rank, size, group=group, dtype=dtype, device=device)
    return TorchExecutor(model, **executor_options)


def load_tensor_parallel_executor(
    path: str | Path, rank: int, size: int, **options: Any
) -> TorchExecutor:
    """``tensor_parallel_executor`` from a Hugging Face directory or GGUF file. Every rank reads the
    whole checkpoint (fp32) and keeps its slices; the size is checked before any weight is read."""
    cfg = gguf_config(read_gguf(path)) if is_gguf(path) else load_config(path)
    check_tensor_parallel(cfg, size)
    cfg, state = load_state_dict(path)
    return tensor_parallel_executor(cfg, state, rank, size, **options)


# A collective waits for peers computing the same layer of the same forward: far less than this,
# even for a long prompt; past it a stopped or hung rank counts as lost.
COLLECTIVE_TIMEOUT_S = 300.0
# A follower waits for its next call while the target idles, which may be for days.
CONTROL_TIMEOUT = timedelta(days=3650)
# Starting a follower: importing torch and reading the whole checkpoint (each rank keeps its slices).
START_TIMEOUT_S = 600.0
# How long close() lets followers exit by themselves after Shutdown before they are killed.
EXIT_GRACE_S = 30.0
# How long a failed collective waits to see which follower exited (its socket closes just before).
EXIT_NOTICE_S = 2.0
STORE_HOST = "127.0.0.1"  # every rank runs on this host
JOINED_KEY = "trtssd/tensor_parallel/joined/{rank}"  # a follower is up and about to join the group
POLL_S = 0.05


class TensorParallelLost(RuntimeError):
    """A target rank is gone: the tensor-parallel target cannot go on (requests in flight end
    with this error; close the LLM)."""


# --- messages: rank 0 -> followers, and back once at start ---------------------------------------


@dataclass(frozen=True)
class ShardSetup:
    """What a follower loads: its shard of the same weights, with rank 0's executor settings."""

    weights: str  # Hugging Face directory or .gguf file
    dtype: str  # "float32" or "bfloat16"
    device: str  # rank 0's device ("cpu", "cuda:N"); rank r uses rank_device(device, r)
    cores: tuple[int, ...] | None  # the target's cores (every target rank runs on them)
    threads: int  # torch threads per rank
    executor_options: dict[str, Any] = field(default_factory=dict)  # max_seqs, max_seq_len, ...


@dataclass(frozen=True)
class RankReady:
    """A rank's answer to ShardSetup: loaded, or why not."""

    rank: int
    pid: int
    error: str | None = None
    load_time_s: float = 0.0


@dataclass(frozen=True)
class Mirror:
    """The calls every follower makes next, in order: rank 0's bookkeeping calls since the last
    message (each ``(method, args)``), then one forward of ``chunks`` (None: none), then exit
    when ``shutdown``."""

    calls: tuple[tuple[str, tuple], ...] = ()
    chunks: tuple[Chunk, ...] | None = None
    # Rank 0's committed length of each chunk's sequence: a follower whose own differ has missed
    # a call, and exits at once instead of leaving rank 0 waiting in a collective that cannot pair.
    committed: tuple[int, ...] = ()
    shutdown: bool = False


# The bookkeeping calls a follower makes after rank 0, by the name a `Mirror` carries.
MIRRORED_CALLS = {"add_sequence": TorchExecutor.add_sequence, "release": TorchExecutor.release,
                  "commit": TorchExecutor.commit, "share_prefix": TorchExecutor.share_prefix,
                  "copy_slots": TorchExecutor.copy_slots}
REQUEST_ERRORS = (ValueError, CapacityError)  # raised by a forward's checks, before any collective


def send(message: object, group: dist.ProcessGroup) -> None:
    """Rank 0: one message to every follower (pickled, over the control group)."""
    dist.broadcast_object_list([message], src=0, group=group)


def receive(group: dist.ProcessGroup) -> object:
    """A follower: the next message from rank 0 (waits as long as rank 0 is alive)."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_ready(ready: RankReady, group: dist.ProcessGroup) -> list[RankReady]:
    """Every rank's RankReady, on every rank."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, ready, group=group)
    return out


# --- the group -------------------------------------------------------------------------------------


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the host for "cpu", else the CUDA device ``rank`` places after rank 0's."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return str(dev)
    return f"cuda:{(dev.index or 0) + rank}"


def join_group(store: dist.Store, rank: int, size: int, device: str) -> dist.ProcessGroup:
    """Join the compute group (the default process group: NCCL on CUDA, gloo on CPU) and return
    the control group (gloo, for the calls). Collective: every rank calls it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before NCCL's first collective: one device per rank
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_shard(setup: ShardSetup, rank: int, size: int) -> TorchExecutor:
    return load_tensor_parallel_executor(setup.weights, rank, size, dtype=_DTYPES[setup.dtype],
                                         device=rank_device(setup.device, rank), **setup.executor_options)


# --- rank 0 ------------------------------------------------------------------------------------------


@dataclass
class Follower:
    """A follower as rank 0 sees it: a process rank 0 started (``tree``), or a rank of the same
    ``mpiexec`` job (launch "world"; known by pid and start time, so a reused pid is not it)."""

    rank: int
    pid: int
    tree: ProcessTree | None = None
    started: float | None = None  # world ranks: the process's start time

    def running(self) -> bool:
        if self.tree is not None:
            return self.tree.running()
        return self.started is not None and start_time(self.pid) == self.started

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def end(self) -> bool:
        """Kill it if it still runs; True when it had to be killed."""
        if self.tree is not None:
            return bool(self.tree.end(0.0).killed)
        if not self.running():
            return False
        os.kill(self.pid, signal.SIGKILL)
        return True

    def describe(self) -> str:
        code = self.tree.process.poll() if self.tree is not None else None
        state = "running" if self.running() else "exited" if code is None else f"exited with code {code}"
        return f"target rank {self.rank} (pid {self.pid}) {state}"


class TensorParallelExecutor:
    """Rank 0's executor: its own shard, every call that changes the KV state mirrored to the
    followers (module docstring). Implements the Executor protocol; ``close`` ends the followers."""

    def __init__(self, shard: TorchExecutor, control: dist.ProcessGroup, followers: list[Follower],
                 store: dist.Store):
        self.shard = shard
        self.size = len(followers) + 1
        self._control = control
        self._followers = followers
        self._store = store  # rank 0 serves the rendezvous store: kept alive with the group
        self._pending: list[tuple[str, tuple]] = []
        self.failure: str | None = None  # why the group was lost; None while it runs
        self._closed = False
        # What the runtime reads of an executor is the shard's: every rank's KV rows are its shard's,
        # so prompts split by the same rule as at T = 1; it shares prefixes (mirrored), it neither
        # saves them nor lends threads (the shard, a TorchExecutor, declares so).
        self.vocab_size, self.max_seq_len = shard.vocab_size, shard.max_seq_len
        self.capabilities = shard.capabilities
        self.upkeep_s = 0.0

    def cost_identity(self) -> dict:
        """The shard's: its local config names its share of heads, so a stored calibration of
        T = 1 is never taken for this one."""
        return {**self.shard.cost_identity(), "executor": type(self).__name__}

    def committed(self, seq_id: int) -> int:
        return self.shard.committed(seq_id)

    # -- the executor protocol --------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        self._mirrored("add_sequence", seq_id)

    def release(self, seq_id: int) -> None:
        # Never refused: freeing rows is also the cleanup after a failure.
        self.shard.release(seq_id)
        if self.failure is None:
            self._pending.append(("release", (seq_id,)))

    def commit(self, seq_id: int, n_tokens: int) -> None:
        self._mirrored("commit", seq_id, n_tokens)

    def share_prefix(self, src_seq_id: int, dst_seq_id: int, n_tokens: int) -> None:
        self._mirrored("share_prefix", src_seq_id, dst_seq_id, n_tokens)

    def spare_rows(self, tokens: int) -> int:
        return 0  # every row of a forward costs its compute here

    def copy_slots(self, seq_id: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._check_alive()
        self.shard.copy_slots(seq_id, src, dst)
        self._pending.append(("copy_slots", (seq_id, _host(src), _host(dst))))

    def _mirrored(self, method: str, *args) -> None:
        """A bookkeeping call on rank 0's shard, queued for the followers once it succeeded."""
        self._check_alive()
        MIRRORED_CALLS[method](self.shard, *args)
        self._pending.append((method, args))

    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        self._check_alive()
        if not chunks:
            return []
        committed = tuple(self.shard.committed(c.seq_id) for c in chunks)  # unknown ids: refused here
        message = Mirror(tuple(self._pending), tuple(chunk_on_host(c) for c in chunks), committed)
        self._pending = []
        try:
            send(message, self._control)
            return self.shard.forward(chunks)
        except REQUEST_ERRORS:
            raise  # every rank refused the same forward before any collective: the group goes on
        except Exception as err:  # noqa: BLE001 - a collective failed: a rank is gone or hung
            raise self._lost(f"{type(err).__name__}: {err}") from err

    # -- failures and the end ---------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._closed:
            raise TensorParallelLost("the tensor-parallel target is closed")
        if self.failure is not None:
            raise TensorParallelLost(self.failure)
        if not all(f.running() for f in self._followers):
            raise self._lost(None)

    def _lost(self, error: str | None) -> TensorParallelLost:
        """Mark the group lost, end every follower, and return the error to raise."""
        if self.failure is None:
            if error is not None:  # a follower's socket closes just before its exit shows: wait for it
                deadline = time.monotonic() + EXIT_NOTICE_S
                while all(f.running() for f in self._followers) and time.monotonic() < deadline:
                    time.sleep(POLL_S)
            gone = [f.describe() for f in self._followers if not f.running()]
            cause = "; ".join(gone) if gone else f"a collective failed ({error})"
            self.failure = (f"tensor-parallel target lost: {cause}; the requests in flight cannot finish "
                            f"(tensor_parallel_size={self.size}); close this LLM and start a new one")
            log.error("%s", self.failure)
            self._end_followers(self._followers)
            leave_group()
        return TensorParallelLost(self.failure)

    @staticmethod
    def _end_followers(followers: list[Follower]) -> None:
        for f in followers:
            if f.end():
                log.info("killed %s", f.describe())

    def close(self) -> None:
        """Shut the followers down (killing any that do not exit) and leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            try:
                send(Mirror(shutdown=True), self._control)
            except Exception as err:  # noqa: BLE001 - ending them anyway
                log.warning("could not tell the target's followers to shut down (%s): killing them", err)
            # A follower of ours exits now; a world rank goes on to MPI_Finalize, which it leaves
            # only beside the job's other ranks, this one among them: it is not waited for.
            started = [f for f in self._followers if f.tree is not None]
            for f in started:
                f.wait(EXIT_GRACE_S)
            self._end_followers(started)
            leave_group()
        self._store = None
        self.shard.close()


def _host(t: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(t).detach().to("cpu", torch.long)


# --- starting the target group --------------------------------------------------------------------


def shard_weights(ref: ModelRef, size: int) -> tuple[str, str, bool]:
    """(weights path, dtype, plain_weights) of a target to split ``size`` ways; a clear error for
    a target the torch backend does not run in its own precision (only it is split)."""
    def refuse(backend: str) -> ValueError:
        return ValueError(f"tensor_parallel_size must be 1 for a target on the {backend!r} backend (only the "
                          f"'torch' backend's fp32 or bf16 target is split across ranks); got {size} for {ref.path}")

    if is_engine_dir(ref.path):
        entry = load_manifest(Path(ref.path))[ref.side]
        if entry["backend"] != "torch":
            raise refuse(entry["backend"])
        return str(Path(ref.path) / entry["path"]), entry.get("dtype", "float32"), entry.get("plain_weights", True)
    if ref.backend != "torch":
        raise refuse(ref.backend)
    return ref.path, ref.dtype, True


def start_tensor_parallel_target(ref: ModelRef, runtime: RuntimeConfig, *, max_seqs: int, max_seq_len: int,
                                 max_batch_tokens: int | None, targets: MPI.Intracomm | None = None,
                                 ) -> TensorParallelExecutor:
    """Start followers 1..T-1 (T = ``runtime.tensor_parallel_size``), or meet them as the ranks
    of ``targets`` (launch "world": ranks 0..T-1 of the mpiexec job, already running
    `serve_in_world`), load rank 0's shard here, and return rank 0's
    executor once every rank has loaded its own. Refuses, before starting anything, a backend
    other than torch and a size that does not divide the model's heads."""
    size = runtime.tensor_parallel_size
    weights, dtype, plain_weights = shard_weights(ref, size)
    check_tensor_parallel(load_config(weights), size)
    device = str(resolve_device(runtime.target_device, "target_device"))
    _check_devices(device, size)
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process: one "
                           "tensor-parallel target per process (tensor_parallel_size > 1)")
    setup = ShardSetup(weights, dtype, device, runtime.target_cores, runtime.target_threads,
                       {"max_seqs": max_seqs, "max_seq_len": max_seq_len, "max_batch_tokens": max_batch_tokens,
                        "plain_weights": plain_weights})
    store = dist.TCPStore(STORE_HOST, 0, size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    followers: list[Follower] = []
    try:
        followers = (_meet_world_followers(targets, store.port, device) if targets is not None else
                     [_start_follower(r, size, store.port, device) for r in range(1, size)])
        _wait_until_joined(store, followers)
        control = join_group(store, 0, size, device)
        send(setup, control)
        t0 = time.perf_counter()
        shard, error = None, None
        try:
            shard = load_shard(setup, 0, size)
        except Exception as err:  # noqa: BLE001 - reported below, after the followers answered
            error = f"{type(err).__name__}: {err}"
        answers = gather_ready(RankReady(0, os.getpid(), error, time.perf_counter() - t0), control)
        failed = [a for a in answers if a.error is not None]
        if failed:
            raise RuntimeError("tensor-parallel target did not start: " +
                               "; ".join(f"rank {a.rank}: {a.error}" for a in failed))
        log.info("tensor-parallel target: %d ranks ready (pids %s; loaded in %s s)", size,
                 [a.pid for a in answers], [round(a.load_time_s, 1) for a in answers])
        return TensorParallelExecutor(shard, control, followers, store)
    except BaseException:
        for f in followers:
            f.end()
        leave_group()
        raise


def _check_devices(device: str, size: int) -> None:
    dev = torch.device(device)
    if dev.type == "cuda" and (dev.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} from target_device {device!r} needs CUDA devices "
                         f"{dev.index or 0}..{(dev.index or 0) + size - 1}; this machine has "
                         f"{torch.cuda.device_count()}")


def _start_follower(rank: int, size: int, port: int, device: str) -> Follower:
    level = logging.getLevelName(logging.getLogger("trtssd").getEffectiveLevel())
    command = [sys.executable, "-m", "trtssd.backends.tensor_parallel", "--rank", str(rank), "--size", str(size),
               "--store-port", str(port), "--leader-pid", str(os.getpid()), "--device", device,
               "--log-level", str(level)]
    tree = ProcessTree(command, env=dict(os.environ))
    return Follower(rank, tree.process.pid, tree)


@dataclass(frozen=True)
class WorldRendezvous:
    """Rank 0 to the follower ranks of a launch "world" job: where to meet, and whom to outlive."""

    store_port: int
    leader_pid: int
    device: str  # rank 0's; rank r's follows from it (`rank_device`)


def _meet_world_followers(targets: MPI.Intracomm, port: int, device: str) -> list[Follower]:
    """Tell ranks 1..T-1 of ``targets`` where rank 0's store listens; learn their pids.
    Collective with `serve_in_world`."""
    targets.bcast(WorldRendezvous(port, os.getpid(), device), root=0)
    pids = targets.gather(os.getpid(), root=0)
    return [Follower(r, pid, started=start_time(pid)) for r, pid in enumerate(pids) if r > 0]


def _wait_until_joined(store: dist.TCPStore, followers: list[Follower]) -> None:
    """Until every follower is up (its key is in the store): fail at once, naming it, when one
    exits first, and after START_TIMEOUT_S when one never comes (the group's rendezvous itself
    would wait without noticing either)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = list(followers)
    while waiting:
        waiting = [f for f in waiting if not store.check([JOINED_KEY.format(rank=f.rank)])]
        dead = [f for f in waiting if not f.running()]
        if dead:
            raise RuntimeError("tensor-parallel target did not start: " + "; ".join(f.describe() for f in dead))
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel target did not start: ranks {[f.rank for f in waiting]} did not "
                               f"join within {START_TIMEOUT_S:.0f} s")
        if waiting:
            time.sleep(POLL_S)

# --- a follower ----------------------------------------------------------------------------------


def serve(rank: int, size: int, store: dist.Store, device: str) -> None:
    """A follower: join rank 0's group, load the shard `ShardSetup` names, and replay each
    `Mirror` message until told to shut down; exit on any error that could leave this rank's KV
    unlike rank 0's. ``device``: rank 0's; this rank's follows from it (`rank_device`)."""
    store.set(JOINED_KEY.format(rank=rank), str(os.getpid()))
    control = join_group(store, rank, size, rank_device(device, rank))
    setup: ShardSetup = receive(control)
    executor = _load(setup, rank, size, control)
    if executor is not None:
        _replay(executor, control)


def _load(setup: ShardSetup, rank: int, size: int, control: dist.ProcessGroup) -> TorchExecutor | None:
    pin("target", setup.cores, setup.threads)
    t0 = time.perf_counter()
    executor, error = None, None
    try:
        executor = load_shard(setup, rank, size)
    except Exception as err:  # noqa: BLE001 - reported to rank 0, which fails to start with it
        log.exception("loading the shard failed")
        error = f"{type(err).__name__}: {err}"
    gather_ready(RankReady(rank, os.getpid(), error, time.perf_counter() - t0), control)
    return executor


def _replay(executor: TorchExecutor, control: dist.ProcessGroup) -> None:
    while True:
        message: Mirror = receive(control)
        for name, args in message.calls:
            if name not in MIRRORED_CALLS:
                raise TypeError(f"unexpected call {name!r} from rank 0")
            # Rank 0 made this call successfully on the same state: failing here means the ranks
            # differ, and the exception ends this rank (rank 0 then loses the group).
            MIRRORED_CALLS[name](executor, *args)
        if message.chunks is not None:
            mine = tuple(executor.committed(c.seq_id) for c in message.chunks)
            if mine != message.committed:
                raise RuntimeError(f"this rank's sequences differ from rank 0's (committed tokens {mine}, rank 0 "
                                   f"{message.committed}): a call was lost")
            try:
                executor.forward(list(message.chunks))
            except REQUEST_ERRORS as err:
                log.debug("forward refused on every rank: %s", err)  # rank 0 raised the same
        if message.shutdown:
            return


def serve_in_world(targets: MPI.Intracomm) -> None:
    """A follower rank of a launch "world" job: meet rank 0 (collective with its
    `_meet_world_followers` over ``targets``), then serve as a started follower does."""
    rendezvous: WorldRendezvous = targets.bcast(None, root=0)
    targets.gather(os.getpid(), root=0)
    rank, size = targets.Get_rank(), targets.Get_size()
    _serve_until_done(rank, size, rendezvous.store_port, rendezvous.leader_pid, rendezvous.device)


def _serve_until_done(rank: int, size: int, store_port: int, leader_pid: int, device: str) -> None:
    exit_with(leader_pid, lambda: log.warning("rank 0 (pid %d) is gone: exiting", leader_pid))
    store = dist.TCPStore(STORE_HOST, store_port, size, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    try:
        serve(rank, size, store, device)
    except Exception:  # noqa: BLE001 - logged; rank 0 sees this rank exit
        log.exception("target rank %d failed", rank)
        os._exit(1)  # a clean exit could wait on peers that are gone
    leave_group()


def main(argv: list[str] | None = None) -> None:
    """A follower's process, as rank 0 starts it (`_start_follower`)."""
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
    # Run as the module rank 0 imports, not as __main__: what this rank pickles (RankReady) must
    # name its classes by the module rank 0 knows them by.
    from trtssd.backends.tensor_parallel import main as follower_main

    follower_main()
    sys.exit(0)
