"""Starting the ranks: the target's (`start_target`) and a draft rank (`start_draft`), one function
each for every caller (``LLM``, the TensorRT-LLM drafter).

launch "spawn" starts the draft as its own MPI job (survives a dying draft), "world" uses the
last rank of an ``mpiexec -n T+1`` job (trtssd/runtime/world.py), "local" runs it in this
process (tests, debugging). A target of ``tensor_parallel_size`` T > 1 is rank 0 here plus T - 1
followers (trtssd/backends/tensor_parallel.py): processes this process starts (launch "spawn" or
"local"), or ranks 1..T-1 of the mpiexec job (launch "world").
"""

from __future__ import annotations

import json
from pathlib import Path

from trtssd.backends.base import Executor
from trtssd.backends.loading import load_executor
from trtssd.backends.tensor_parallel import start_tensor_parallel_target
from trtssd.config import ModelRef, RuntimeConfig, SpeculativeConfig, VerifierKind, batch_tokens
from trtssd.runtime.draft_client import DraftClient, DraftLink, LocalDraft
from trtssd.runtime.draft_rank import load_worker
from trtssd.runtime.world import world_groups

LAUNCHES = ("spawn", "world", "local")


def target_seq_len(spec: SpeculativeConfig, runtime: RuntimeConfig) -> int:
    """Positions the target holds per sequence: room for the verify block on top of max_model_len."""
    return runtime.max_model_len + spec.k + 1


def draft_seq_len(spec: SpeculativeConfig, runtime: RuntimeConfig) -> int:
    """Positions the draft holds per sequence: the target's plus glue and tree scratch."""
    return target_seq_len(spec, runtime) + spec.k * spec.budget


def start_target(target: ModelRef, spec: SpeculativeConfig, runtime: RuntimeConfig, launch: str) -> Executor:
    """The target's executor: loaded here (T = 1), or rank 0 of a tensor-parallel group whose
    followers this starts (T > 1; `close_target` ends them)."""
    if launch not in LAUNCHES:
        raise ValueError(f"launch must be one of {LAUNCHES}; got {launch!r}")
    options = dict(max_seqs=runtime.max_batch, max_seq_len=target_seq_len(spec, runtime),
                   max_batch_tokens=batch_tokens(spec, runtime))
    if runtime.tensor_parallel_size > 1 and runtime.verifier is VerifierKind.TRTLLM:
        # TensorRT-LLM runs its engine's T ranks itself (trtssd/trtllm/executor_target.py: the
        # executor's orchestrator or leader mode); the torch target kept for prefill and the request
        # checks loads whole, as at T = 1.
        engine_tp = _trtllm_engine_tp_size(runtime.trtllm_engine_dir)
        if engine_tp != runtime.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={runtime.tensor_parallel_size} but the TensorRT-LLM engine in "
                             f"{runtime.trtllm_engine_dir} has tp_size={engine_tp}; rebuild it with `trtssd build "
                             f"--backend trtllm --tp-size {runtime.tensor_parallel_size}` or run with "
                             f"tensor_parallel_size={engine_tp}")
        if launch == "world":
            # Its ranks 1..T-1 start torch followers and its last rank the draft, which never
            # imports tensorrt_llm, whose import is collective over the world (check_runnable).
            raise ValueError(f"launch 'world' cannot run a TensorRT-LLM engine of tensor_parallel_size="
                             f"{runtime.tensor_parallel_size}: use launch 'spawn' or 'local' (TensorRT-LLM's "
                             "orchestrator mode starts the engine's ranks; docs/tensorrt_llm.md, Tensor parallelism)")
    if runtime.tensor_parallel_size == 1 or runtime.verifier is VerifierKind.TRTLLM:
        return load_executor(target, device=runtime.target_device, device_field="target_device",
                             kept_prompts=runtime.kept_sequences, row_invariant=runtime.row_invariant, **options)
    targets = world_groups(runtime.tensor_parallel_size).targets if launch == "world" else None
    options["max_seqs"] += runtime.kept_sequences  # torch keeps kept prompts as sequences (load_side)
    return start_tensor_parallel_target(target, runtime, targets=targets, **options)


def _trtllm_engine_tp_size(engine_dir: str) -> int:
    """The tp size trtllm-build recorded in its config.json; read here without trtssd.trtllm,
    which sits above the runtime (tests/test_layering.py)."""
    config = Path(engine_dir) / "config.json"
    try:
        return json.loads(config.read_text())["pretrained_config"]["mapping"]["tp_size"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"trtllm_engine_dir: no tp_size readable from {config} (pretrained_config.mapping of a "
                         f"trtllm-build output): {err!r}") from None


def close_target(executor: Executor) -> None:
    """Free the target's model and KV now, and end what `start_target` started beside it (a
    tensor-parallel target's followers)."""
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
        link = world_groups(runtime.tensor_parallel_size).link
        return DraftLink.from_world(link, draft, spec, runtime, vocab_size, draft_len)
    return DraftLink.spawn(draft, spec, runtime, vocab_size, draft_len)
