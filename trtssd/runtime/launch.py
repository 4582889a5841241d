"""Starting a draft rank: one function for every caller (``LLM``, the TensorRT-LLM drafter).

launch "spawn" starts the draft as its own MPI job (survives a dying draft), "world" uses the
last rank of an ``mpiexec -n 2`` job, "local" runs it in this process (tests, debugging).
"""

from __future__ import annotations

from trtssd.config import ModelRef, RuntimeConfig, SpeculativeConfig
from trtssd.runtime.draft_client import DraftClient, LocalDraft
from trtssd.runtime.draft_link import DraftLink
from trtssd.runtime.draft_server import load_worker
from trtssd.runtime.transport import require_mpi

LAUNCHES = ("spawn", "world", "local")


def target_seq_len(spec: SpeculativeConfig, runtime: RuntimeConfig) -> int:
    """Positions the target holds per sequence: room for the verify block on top of max_seq_len."""
    return runtime.max_seq_len + spec.k + 1


def draft_seq_len(spec: SpeculativeConfig, runtime: RuntimeConfig) -> int:
    """Positions the draft holds per sequence: the target's plus glue and tree scratch."""
    return target_seq_len(spec, runtime) + spec.k * spec.budget


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
