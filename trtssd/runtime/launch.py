"""Starting the ranks: the target's (`start_target`) and a draft rank (`start_draft`), one function
each for every caller (``LLM``, the TensorRT-LLM drafter).

launch "spawn" starts the draft as its own MPI job (survives a dying draft), "world" uses the
last rank of an ``mpiexec -n 2`` job, "local" runs it in this process (tests, debugging). A
target of ``tensor_parallel_size`` T > 1 is rank 0 here plus T - 1 follower processes this
process starts (trtssd/runtime/tensor_parallel.py), with launch "spawn" or "local".
"""

from __future__ import annotations

from trtssd.backends.base import Executor
from trtssd.backends.loading import load_executor
from trtssd.config import ModelRef, RuntimeConfig, SpeculativeConfig, TargetBackend, batch_tokens
from trtssd.runtime.draft_client import DraftClient, LocalDraft
from trtssd.runtime.draft_link import DraftLink
from trtssd.runtime.draft_server import load_worker
from trtssd.runtime.tensor_parallel import TensorParallelExecutor, start_tensor_parallel_target
from trtssd.runtime.transport import require_mpi

LAUNCHES = ("spawn", "world", "local")


def target_seq_len(spec: SpeculativeConfig, runtime: RuntimeConfig) -> int:
    """Positions the target holds per sequence: room for the verify block on top of max_seq_len."""
    return runtime.max_seq_len + spec.k + 1


def draft_seq_len(spec: SpeculativeConfig, runtime: RuntimeConfig) -> int:
    """Positions the draft holds per sequence: the target's plus glue and tree scratch."""
    return target_seq_len(spec, runtime) + spec.k * spec.budget


def start_target(target: ModelRef, spec: SpeculativeConfig, runtime: RuntimeConfig, launch: str) -> Executor:
    """The target's executor: loaded here (T = 1), or rank 0 of a tensor-parallel group whose
    followers this starts (T > 1; `close_target` ends them)."""
    if launch not in LAUNCHES:
        raise ValueError(f"launch must be one of {LAUNCHES}; got {launch!r}")
    options = dict(max_seqs=runtime.kv_sequences, max_seq_len=target_seq_len(spec, runtime),
                   max_batch_tokens=batch_tokens(spec, runtime))
    if runtime.tensor_parallel_size == 1:
        return load_executor(target, device=runtime.target_device, device_field="target_device", **options)
    if runtime.target_backend is not TargetBackend.TORCH:
        raise ValueError(f"tensor_parallel_size must be 1 with target_backend {runtime.target_backend.value!r} (only "
                         f"the torch target is split; TensorRT-LLM tensor parallelism is not built); got "
                         f"{runtime.tensor_parallel_size}")
    if launch == "world":
        # Under mpiexec MPICH ends every rank when one dies, and the draft's window is made over
        # the two ranks of an ``-n 2`` job: rank 0 starts its followers itself instead.
        raise ValueError(f"tensor_parallel_size={runtime.tensor_parallel_size} needs launch 'spawn' or 'local' (the "
                         "target's follower ranks are started by this process); launch 'world' allows only "
                         "tensor_parallel_size 1")
    return start_tensor_parallel_target(target, runtime, **options)


def close_target(executor: Executor) -> None:
    """End what `start_target` started beside the executor (a tensor-parallel target's followers)."""
    if isinstance(executor, TensorParallelExecutor):
        executor.close()


def start_draft(launch: str, draft: ModelRef, spec: SpeculativeConfig, runtime: RuntimeConfig,
                vocab_size: int) -> DraftClient:
    """A running draft rank for ``draft``, checked against the target's ``vocab_size``.
    The caller owns it: ``close()`` ends it with nothing left behind."""
    if launch not in LAUNCHES:
        raise ValueError(f"launch must be one of {LAUNCHES}; got {launch!r}")
    draft_len = draft_seq_len(spec, runtime)
    if launch == "local":
        worker = load_worker(draft, spec, runtime, draft_len)
        if worker.executor.vocab_size != vocab_size:
            raise ValueError(f"draft vocab_size {worker.executor.vocab_size} != target vocab_size {vocab_size}")
        return LocalDraft(worker, runtime.max_batch)
    if launch == "world":
        world = require_mpi("launch='world'").COMM_WORLD
        if world.Get_size() < 2:
            raise RuntimeError("launch='world' needs mpiexec -n 2 (the last rank is the draft)")
        return DraftLink.from_world(world, draft, spec, runtime, vocab_size, draft_len)
    return DraftLink.spawn(draft, spec, runtime, vocab_size, draft_len)
