"""The target's verification on a TensorRT-LLM 1.2.x engine, through the Executor API.

Each round, every running sequence becomes one Executor ``Request`` (TensorRT-LLM's
draft-target flow, as in its ``examples/run.py`` and Triton BLS ``decode.py``): its input is the
whole sequence so far (ending with the pending bonus token; KV block reuse finds the cached
prefix), ``max_tokens`` is the number of drafts + 1, and ``ExternalDraftTokensConfig`` carries the
chain the draft rank answered with. The response's output token ids are the accepted drafts
followed by the target's own next token; :func:`derive_outcome` turns them into our outcome
(accepted count, bonus) for the draft rank. The SSD draft loop, cache and protocol are unchanged.

Acceptance rule, checked against TensorRT-LLM's source (ExternalDraftTokensLayer, the decoding
layer ``cpp/tensorrt_llm/layers/decodingLayer.cpp`` picks for external draft tokens; files
``cpp/tensorrt_llm/layers/externalDraftTokensLayer.cpp``,
``cpp/tensorrt_llm/kernels/speculativeDecoding/externalDraftTokensKernels.cu``,
``cpp/tensorrt_llm/layers/layersFactory.h``):

- With draft logits it is docs/algorithm.md section 5. p: the target's logits after the penalty
  layer (temperature; it runs first, layersFactory.h), masked to TensorRT-LLM's own top-k/top-p
  set and softmaxed. q: ``softmax(draft logits)`` with no temperature. Accept draft i iff
  ``p(s) > u * q(s)`` with ``u = curand_uniform`` in (0, 1] (older kernels: reject iff
  ``p/q < u``), i.e. with probability min(1, p/q), unless a constant ``acceptance_threshold`` is
  given (the source says those are for testing; we never set one). On the first rejection p
  becomes ``max(p - q, 0)`` renormalised and the bonus is sampled from it; after all drafts are
  accepted the bonus is sampled from p. Same ratio rule, same residual.
- Without draft logits it compares the draft with a token the target sampled, and on a mismatch
  samples the bonus afresh from p, *not* from p with the draft removed: exact for greedy (p is
  one-hot), not for sampled rows. So sampled rows always send logits, point-mass rows (greedy
  drafts at T > 0, n-gram or random backups) as one-hot logits: ``q = delta_s`` turns the same
  kernel into the point-mass rule (accept with p(s), residual p without s).
- Differences that remain: p is TensorRT-LLM's processed distribution (its top-k/top-p kernels, not
  ``trtssd.sampling``; min_p is not applied by that layer, so min_p is rejected here), and q is
  recomputed from our logits in the decoder's dtype (build the target with
  ``--logits_dtype float32``, as ``build_commands`` does).

Parallelism. An engine built with ``tp_size`` T > 1 (``trtssd build --backend trtllm --tp-size
T``) is T processes, one ``rank<r>.engine`` and one GPU each, and TensorRT-LLM's C++ Executor
runs them in one of two modes (``ParallelConfig``; ``cpp/tensorrt_llm/executor/executorImpl.cpp``):

- orchestrator: this process is not an engine rank. Its Executor spawns the T ranks with
  ``MPI_Comm_spawn`` of TensorRT-LLM's ``bin/executorWorker`` and forwards requests and responses
  to them. TensorRT-LLM requires this process's MPI world to have size 1: a plain ``python`` or
  ``trtssd`` process, the draft started by launch "spawn" or "local".
- leader: the T ranks are ranks of this MPI job (``mpiexec -n T``); every one makes the Executor,
  the first participant (rank 0, here) is the leader that enqueues requests and gets responses
  (``can_enqueue_requests``), the others serve until the leader shuts down (:func:`serve_follower`).

:func:`choose_parallel_plan` picks the mode from the engine's size (its config.json) and the MPI
world; a world of T + 1 whose last rank is trtssd's draft is refused (:func:`check_runnable` says
why). Everything above :func:`plan_for_engine` is plain logic with no TensorRT-LLM import;
:class:`TrtllmTargetExecutor` and :func:`serve_follower` are unverified: never run.
"""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from trtssd.runtime import protocol as P
from trtssd.runtime.transport import require_mpi
from trtssd.sampling import SamplingParams
from trtssd.trtllm.availability import (PACKAGE, TensorRTLLMMissing, import_tensorrt_llm, missing_message,
                                        tensorrt_llm_available)

log = logging.getLogger(__name__)

NEEDED_FOR = "The TensorRT-LLM target executor"
# trtllm-build's engine description (tensorrt_llm/builder.py Engine.save), which the Executor
# itself parses for the engine's parallelism (cpp/tensorrt_llm/runtime/gptJsonConfig.cpp).
ENGINE_CONFIG = "config.json"
# The worker program orchestrator mode spawns, inside the tensorrt_llm package (what
# tensorrt_llm/runtime/model_runner_cpp.py passes as OrchestratorConfig's worker path).
WORKER_EXECUTABLE = ("bin", "executorWorker")

# A logit whose softmax weight is exactly 0 in fp32 and fp16 (exp underflows); finite, so a
# softmax never computes inf - inf.
LOG_ZERO = -1.0e4
# Finish reasons (TensorRT-LLM's FinishReason names, lower-cased) that end a request at a stop.
STOP_REASONS = ("end_id", "stop_words")


@dataclass(frozen=True)
class VerifyRequest:
    """One sequence's verification, in the Executor's terms (fields of ``executor.Request``)."""

    input_token_ids: tuple[int, ...]  # the sequence so far; its last token is the pending bonus
    max_tokens: int  # len(draft_tokens) + 1: the accepted drafts and the target's next token
    draft_tokens: tuple[int, ...]  # the chain to verify (may be empty: a plain decode step)
    # [len(draft_tokens), vocab] float32 logits whose softmax is the q each draft was sampled
    # from; None for greedy rows (token equality is exact there).
    draft_logits: torch.Tensor | None
    end_id: int | None  # stop token; None: TensorRT-LLM's default


@dataclass(frozen=True)
class RoundOutcome:
    """What the target emitted for one sequence in one round."""

    num_accepted: int  # drafts accepted (a stop token among them included)
    bonus: int | None  # the target's token after them; None when a stop came inside the drafts
    emitted: tuple[int, ...]  # every token emitted this round, in order (a stop token included)
    stopped: bool  # the request ended at a stop token this round

    def to_protocol(self, seq_id: int) -> P.Outcome:
        """The outcome the draft rank is told about (a stopped sequence is released instead)."""
        if self.bonus is None:
            raise ValueError(f"sequence {seq_id} stopped inside its accepted drafts: it has no next round")
        return P.Outcome(seq_id, self.num_accepted, self.bonus)


# -- requests ------------------------------------------------------------------------------------


def check_supported(params: SamplingParams) -> None:
    """Reject what TensorRT-LLM's external-draft-token acceptance would not honour exactly."""
    if params.min_p > 0:
        raise ValueError("SamplingParams.min_p must be 0 with the TensorRT-LLM target: its external-draft-token "
                         f"acceptance applies temperature, top_k and top_p only; got {params.min_p}")
    if params.logprobs is not None:
        raise ValueError("SamplingParams.logprobs must be None with the TensorRT-LLM target: its rounds do not "
                         f"return the distribution they verify with; got {params.logprobs}")
    if params.constraint is not None:
        raise ValueError("SamplingParams.constraint must be None with the TensorRT-LLM target: its rounds verify "
                         "without the per-position grammar masks exactness needs")
    if params.adjusts_logits:
        # Its penalty layer sees one sequence per request: whether each draft position is penalised
        # with the drafts before it, as exactness needs, is not known (never run).
        raise ValueError("SamplingParams penalties, logit_bias, bad_words_ids and min_tokens must be off with the "
                         "TensorRT-LLM target: its rounds are not known to apply them per draft position")


def sampling_config_fields(params: SamplingParams) -> dict:
    """Keyword arguments of ``executor.SamplingConfig`` (pybind ``executor/request.cpp``)."""
    check_supported(params)
    if params.is_greedy:
        return {"beam_width": 1, "top_k": 1}
    fields = {"beam_width": 1, "temperature": float(params.temperature)}
    if params.top_k > 0:
        fields["top_k"] = params.top_k
    if params.top_p < 1:
        fields["top_p"] = float(params.top_p)
    if params.seed is not None:
        fields["seed"] = params.seed
    return fields


def draft_logits(proposals: Sequence[int], q_rows: torch.Tensor | None, point_mass: bool, vocab_size: int) -> torch.Tensor:
    """[n, vocab] float32 logits for ``ExternalDraftTokensConfig(logits=...)``.

    TensorRT-LLM softmaxes them (no temperature) to get q, so they are log q: the q' rows the
    draft sampled from, or a one-hot row (0 at the draft, LOG_ZERO elsewhere) for a point-mass
    proposal, which makes its ratio rule the point-mass rule.
    """
    n = len(proposals)
    if point_mass or q_rows is None:
        logits = torch.full((n, vocab_size), LOG_ZERO, dtype=torch.float32)
        logits[torch.arange(n), torch.tensor(list(proposals), dtype=torch.long)] = 0.0
        return logits
    if q_rows.dim() != 2 or q_rows.shape[0] < n or q_rows.shape[1] != vocab_size:
        raise ValueError(f"q rows must be [>= {n}, {vocab_size}], got {tuple(q_rows.shape)}")
    q = q_rows[:n].float()
    at_draft = q[torch.arange(n), torch.tensor(list(proposals), dtype=torch.long)]
    if bool((at_draft <= 0).any()):
        raise ValueError("a draft token has probability 0 in its q row: it was not sampled from this q")
    return torch.log(q).clamp(min=LOG_ZERO)


def build_verify_request(sequence: Sequence[int], proposals: Sequence[int], q_rows: torch.Tensor | None,
                         point_mass: bool, params: SamplingParams, remaining: int, vocab_size: int,
                         end_id: int | None = None) -> VerifyRequest:
    """One sequence's request. ``sequence``: prompt + output so far (its last token is the
    pending bonus); ``proposals``: the K drafts; ``q_rows``: [K, V] q' rows (None for greedy or
    point-mass rows); ``remaining``: tokens the request may still emit (max_tokens - output).
    Drafts that could not all be emitted are cut so that accepted + bonus fit ``remaining``."""
    if not sequence:
        raise ValueError("sequence must hold at least the prompt")
    if remaining < 1:
        raise ValueError(f"remaining must be >= 1 (the request is finished otherwise), got {remaining}")
    check_supported(params)
    drafts = tuple(int(t) for t in proposals[: remaining - 1])
    bad = [t for t in drafts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"draft token ids must be in [0, {vocab_size}); got {bad[:5]}")
    logits = None if params.is_greedy or not drafts else draft_logits(drafts, q_rows, point_mass, vocab_size)
    return VerifyRequest(tuple(int(t) for t in sequence), len(drafts) + 1, drafts, logits, end_id)


# -- outcomes ------------------------------------------------------------------------------------


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def derive_outcome(draft_tokens: Sequence[int], output_token_ids: Sequence[int], finish_reason: str,
                   end_id: int | None) -> RoundOutcome:
    """Our outcome from one response: its generated tokens (input excluded) and finish reason.

    The output is the accepted drafts and then the target's own token, except at a stop:
    TensorRT-LLM does not count the end id in the sequence length (``forwardAcceptedTokensKernel``
    in externalDraftTokensKernels.cu), so an accepted or sampled end id may be missing from the
    output; it is put back here. A rejected draft can never be the
    bonus (docs/algorithm.md section 3), so the first token that differs from the drafts is the
    bonus.
    """
    drafts, out = list(draft_tokens), list(output_token_ids)
    stopped = finish_reason in STOP_REASONS
    n = _common_prefix(out, drafts)
    if len(out) > n + 1:
        raise ValueError(f"response has {len(out)} tokens but only {n} drafts matched: more than one token after "
                         f"the accepted drafts ({out} for drafts {drafts})")
    if len(out) == n + 1:  # the accepted drafts, then the bonus
        return RoundOutcome(n, out[n], tuple(out), stopped)
    if n > 0 and stopped and out[-1] == end_id:  # an accepted end id that was kept in the output
        return RoundOutcome(n, None, tuple(out), True)
    if finish_reason == "end_id" and end_id is not None:  # an end id left out of the output
        if n < len(drafts) and drafts[n] == end_id:  # ... accepted: the stop is inside the drafts
            return RoundOutcome(n + 1, None, (*out, end_id), True)
        return RoundOutcome(n, end_id, (*out, end_id), True)  # ... or the target's own token
    raise ValueError(f"response ends inside the drafts without a stop ({out} for drafts {drafts}, "
                     f"finish reason {finish_reason!r}): max_tokens must be len(drafts) + 1")


# -- parallelism: which processes run the engine ------------------------------------------------


@dataclass(frozen=True)
class EngineParallelism:
    """How an engine is split: ``pretrained_config.mapping`` of its config.json."""

    tp_size: int = 1  # tensor-parallel ranks
    pp_size: int = 1  # pipeline-parallel stages (trtssd builds none; read so the world size is right)
    cp_size: int = 1  # context-parallel ranks (likewise)

    @property
    def world_size(self) -> int:
        """The engine's processes: one rank<r>.engine and one GPU each."""
        return self.tp_size * self.pp_size * self.cp_size


def engine_parallelism(config: Mapping) -> EngineParallelism:
    """From a parsed engine config.json: the fields TensorRT-LLM's own parser reads for an engine
    with a ``version`` (``pretrained_config.mapping`` ``tp_size``, ``pp_size``, ``cp_size``)."""
    try:
        mapping = config["pretrained_config"]["mapping"]
        sizes = {"tp_size": mapping["tp_size"], "pp_size": mapping.get("pp_size", 1),
                 "cp_size": mapping.get("cp_size", 1)}
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"an engine's {ENGINE_CONFIG} needs pretrained_config.mapping.tp_size (trtllm-build "
                         f"writes it); missing {err}") from None
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad:
        raise ValueError(f"pretrained_config.mapping sizes must be ints >= 1; got {bad}")
    return EngineParallelism(**sizes)


def read_engine_parallelism(engine_dir: str | Path) -> EngineParallelism:
    path = Path(engine_dir) / ENGINE_CONFIG
    if not path.is_file():
        raise ValueError(f"trtllm_engine_dir {str(engine_dir)!r} has no {ENGINE_CONFIG}: it is not a trtllm-build "
                         "output (run the build.sh that `trtssd build --backend trtllm` wrote)")
    return engine_parallelism(json.loads(path.read_text()))


def check_engine_tp(engine: EngineParallelism, tensor_parallel_size: int, engine_dir: str | Path) -> None:
    """The run's tensor_parallel_size must be the engine's: TensorRT-LLM cannot re-split an engine."""
    if engine.tp_size != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but the TensorRT-LLM engine in {engine_dir} "
                         f"has tp_size={engine.tp_size} (pretrained_config.mapping of its {ENGINE_CONFIG}); rebuild "
                         f"it with `trtssd build --backend trtllm --tp-size {tensor_parallel_size}` or run with "
                         f"tensor_parallel_size={engine.tp_size}")


class CommunicationMode(str, enum.Enum):
    """TensorRT-LLM's ``CommunicationMode``: who talks to the engine's ranks."""

    LEADER = "leader"  # the engine's ranks are this MPI world's; the first one takes requests
    ORCHESTRATOR = "orchestrator"  # this process, outside the engine, spawns the ranks and feeds them


@dataclass(frozen=True)
class MpiWorld:
    """This process's MPI_COMM_WORLD."""

    size: int = 1
    rank: int = 0


@dataclass(frozen=True)
class ParallelPlan:
    """What ``ParallelConfig`` this process gives TensorRT-LLM's Executor, and its part in it."""

    mode: CommunicationMode
    world_size: int  # the engine's ranks
    # GPU of each engine rank; None: TensorRT-LLM's default (rank r on GPU r of its node).
    device_ids: tuple[int, ...] | None
    # MPI world ranks of the engine (leader mode in a world of more than one process); None:
    # the whole world (its size must then be the engine's), or spawned ranks (orchestrator).
    participant_ids: tuple[int, ...] | None
    rank: int  # this process's MPI world rank
    draft_rank: int | None = None  # the world's rank outside the engine (trtssd's draft), if any

    @property
    def enqueues(self) -> bool:
        """Whether this process sends requests and receives responses (``can_enqueue_requests``):
        the orchestrator, or the leader, which is the first participant."""
        if self.mode is CommunicationMode.ORCHESTRATOR:
            return True
        return self.rank == (self.participant_ids[0] if self.participant_ids else 0)

    @property
    def is_follower(self) -> bool:
        """An engine rank in leader mode that is not the leader: it only serves."""
        if self.mode is not CommunicationMode.LEADER or self.enqueues:
            return False
        return self.rank in (self.participant_ids or range(self.world_size))


def check_device_ids(device_ids: Sequence[int] | None, world_size: int) -> tuple[int, ...] | None:
    """One distinct CUDA device index per engine rank (or None: TensorRT-LLM's default)."""
    if device_ids is None:
        return None
    ids = tuple(device_ids)
    if (len(ids) != world_size or len(set(ids)) != len(ids)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in ids)):
        raise ValueError(f"device_ids must be {world_size} distinct CUDA device indices >= 0, one per engine rank "
                         f"(the engine's world size is {world_size}); got {list(ids)}")
    return ids


def choose_parallel_plan(engine: EngineParallelism, world: MpiWorld,
                         device_ids: Sequence[int] | None = None) -> ParallelPlan:
    """The Executor's parallel mode for an engine of ``engine.world_size`` N ranks:

    - MPI world of 1 (no mpiexec), N = 1: leader mode alone, as a single-GPU engine always ran.
    - MPI world of 1, N > 1: orchestrator mode; TensorRT-LLM spawns the N ranks (devices 0..N-1
      unless given). It insists on a world of 1 for the orchestrator.
    - MPI world of N (``mpiexec -n N``): leader mode, participants 0..N-1, rank 0 the leader.
    - MPI world of N + 1: leader mode, participants 0..N-1, the last rank outside the engine (where
      trtssd's launch "world" puts its draft); see :func:`check_runnable`.
    Any other world cannot hold the engine's ranks and is refused.
    """
    n = engine.world_size
    devices = check_device_ids(device_ids, n)
    if world.size == 1:
        if n == 1:
            return ParallelPlan(CommunicationMode.LEADER, 1, devices, None, world.rank)
        return ParallelPlan(CommunicationMode.ORCHESTRATOR, n, devices or tuple(range(n)), None, world.rank)
    if world.size not in (n, n + 1):
        raise ValueError(f"a TensorRT-LLM engine of {n} rank(s) cannot run in an MPI world of {world.size}: run it "
                         f"without mpiexec (orchestrator mode spawns its ranks), under mpiexec -n {n} (leader mode, "
                         f"every rank an engine rank) or -n {n + 1} (the last rank outside the engine)")
    draft = n if world.size == n + 1 else None
    if world.rank == draft:
        raise ValueError(f"MPI rank {draft} is outside the engine's ranks 0..{n - 1} (the draft's place): it makes "
                         "no TensorRT-LLM executor")
    return ParallelPlan(CommunicationMode.LEADER, n, devices or tuple(range(n)), tuple(range(n)), world.rank, draft)


def check_runnable(plan: ParallelPlan) -> None:
    """Refuse leader mode with a rank outside the engine (trtssd's draft as the world's last rank).

    TensorRT-LLM's Executor would take it: its participant ids keep that rank out of the session
    communicator it builds (``MPI_Comm_create_group`` over the participants,
    ``Executor::Impl::initializeWorkers``). But ``import tensorrt_llm`` splits MPI_COMM_WORLD
    collectively (``Split_type`` at import of ``tensorrt_llm/_utils.py``), so the engine ranks
    block in their import until the draft rank imports it too, and the engine's ranks 1..N-1 must
    run :func:`serve_follower` where trtssd's world launch starts torch followers. Until its
    world launch does both, this refuses here, before anything is imported.
    """
    if plan.draft_rank is None:
        return
    raise ValueError(
        f"TensorRT-LLM leader mode with trtssd's draft as MPI rank {plan.draft_rank} (an MPI world of "
        f"{plan.world_size + 1} for an engine of {plan.world_size} rank(s)) is not supported: importing tensorrt_llm "
        "splits MPI_COMM_WORLD collectively (tensorrt_llm/_utils.py), which blocks the engine's ranks until the draft "
        "rank imports it too, and trtssd's launch 'world' does not start TensorRT-LLM engine ranks. Run without "
        "mpiexec (orchestrator mode) with launch 'spawn' or 'local', or under mpiexec -n "
        f"{plan.world_size} with launch 'spawn' (docs/tensorrt_llm.md, Tensor parallelism)")


def _mpi_world() -> MpiWorld:
    # tensorrt_llm imports mpi4py (so initialises MPI) itself: asking first costs nothing more.
    comm = require_mpi(NEEDED_FOR).COMM_WORLD
    return MpiWorld(comm.Get_size(), comm.Get_rank())


def plan_for_engine(engine_dir: str | Path, device_ids: Sequence[int] | None = None,
                    tensor_parallel_size: int | None = None, world: MpiWorld | None = None) -> ParallelPlan:
    """This process's plan for the engine in ``engine_dir``: from its config.json and the MPI
    world (``world``; None: this process's), checked against ``tensor_parallel_size`` when given,
    and refused where it cannot run (:func:`check_runnable`). Nothing of TensorRT-LLM is imported."""
    engine = read_engine_parallelism(engine_dir)
    if tensor_parallel_size is not None:
        check_engine_tp(engine, tensor_parallel_size, engine_dir)
    plan = choose_parallel_plan(engine, world if world is not None else _mpi_world(), device_ids)
    check_runnable(plan)
    return plan


def _executor_config(ex, plan: ParallelPlan, free_gpu_memory_fraction: float):
    """The ExecutorConfig every process of the engine makes (leader and followers alike).
    unverified: never run."""
    # Block reuse: every round re-submits the whole sequence as a new request; the cached
    # blocks of its prefix are found again instead of recomputed.
    kv_cache = ex.KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction=free_gpu_memory_fraction)
    config = ex.ExecutorConfig(1, kv_cache_config=kv_cache)  # beam width 1: speculation needs it
    config.parallel_config = _parallel_config(ex, plan)
    return config


def _parallel_config(ex, plan: ParallelPlan):
    """``ParallelConfig(communication_type, communication_mode, device_ids, participant_ids,
    orchestrator_config)`` (pybind ``executor/executorConfig.cpp``). unverified: never run."""
    devices = None if plan.device_ids is None else list(plan.device_ids)
    if plan.mode is CommunicationMode.ORCHESTRATOR:
        # Participant ids must stay unset when TensorRT-LLM spawns the ranks itself.
        orchestrator = ex.OrchestratorConfig(is_orchestrator=True, worker_executable_path=str(_worker_executable()))
        return ex.ParallelConfig(ex.CommunicationType.MPI, ex.CommunicationMode.ORCHESTRATOR, device_ids=devices,
                                 orchestrator_config=orchestrator)
    participants = None if plan.participant_ids is None else list(plan.participant_ids)
    return ex.ParallelConfig(ex.CommunicationType.MPI, ex.CommunicationMode.LEADER, device_ids=devices,
                             participant_ids=participants)


def _worker_executable() -> Path:
    path = Path(import_tensorrt_llm(PACKAGE, NEEDED_FOR).__file__).parent.joinpath(*WORKER_EXECUTABLE)
    if not path.is_file():
        raise FileNotFoundError(f"TensorRT-LLM's engine worker {path} is missing: orchestrator mode spawns the "
                                "engine's ranks from it")
    return path


# -- the executor (TensorRT-LLM) ----------------------------------------------------------------


class TrtllmTargetExecutor:
    """Verification rounds on a TensorRT-LLM 1.2.x engine built with
    ``--speculative_decoding_mode draft_tokens_external`` (``trtssd build --backend trtllm``).

    unverified: never run. API from TensorRT-LLM's bindings (``cpp/tensorrt_llm/pybind/executor/
    bindings.cpp``, ``request.cpp``, ``executorConfig.cpp``): ``Executor(model_path, model_type,
    executor_config)``, ``ExecutorConfig(max_beam_width, kv_cache_config=...)`` and its
    ``parallel_config``, ``ParallelConfig(communication_type, communication_mode, device_ids,
    participant_ids, orchestrator_config)``, ``OrchestratorConfig(is_orchestrator,
    worker_executable_path)``, ``KvCacheConfig(enable_block_reuse, free_gpu_memory_fraction=...)``,
    ``Request(input_token_ids, *, max_tokens, sampling_config, output_config, end_id,
    external_draft_tokens_config)``, ``ExternalDraftTokensConfig(tokens, logits=None,
    acceptance_threshold=None)``, ``enqueue_requests`` / ``await_responses`` /
    ``can_enqueue_requests``.
    """

    def __init__(self, engine_dir: str | Path, *, free_gpu_memory_fraction: float = 0.9,
                 response_timeout_s: float = 60.0, device_ids: Sequence[int] | None = None,
                 tensor_parallel_size: int | None = None):
        """``device_ids``: the GPU of each engine rank (default: TensorRT-LLM's, rank r on GPU r);
        ``tensor_parallel_size``: when given, the engine's tp_size must equal it. The engine's
        size and the MPI world choose orchestrator or leader mode (:func:`choose_parallel_plan`)."""
        if not tensorrt_llm_available():  # said first, before the engine or MPI is looked at
            raise TensorRTLLMMissing(missing_message(NEEDED_FOR))
        # Before tensorrt_llm is imported: its import is collective over an MPI world (check_runnable).
        self.plan = plan_for_engine(engine_dir, device_ids, tensor_parallel_size)
        if not self.plan.enqueues:
            raise ValueError(f"MPI rank {self.plan.rank} is a follower of the engine's leader mode (ranks "
                             f"{list(self.plan.participant_ids or ())}, the first the leader): run "
                             "`python -m trtssd.trtllm.executor_target ENGINE_DIR` there, not a target loop")
        self._ex = import_tensorrt_llm("tensorrt_llm.bindings.executor", NEEDED_FOR)
        config = _executor_config(self._ex, self.plan, free_gpu_memory_fraction)
        log.info("TensorRT-LLM engine %s: %d rank(s), %s mode, devices %s", engine_dir, self.plan.world_size,
                 self.plan.mode.value, self.plan.device_ids)
        self._executor = self._ex.Executor(Path(engine_dir), self._ex.ModelType.DECODER_ONLY, config)
        if not self._executor.can_enqueue_requests():  # the plan said this process leads; TensorRT-LLM disagrees
            self._executor.shutdown()
            raise RuntimeError(f"TensorRT-LLM's executor on MPI rank {self.plan.rank} cannot enqueue requests "
                               f"({self.plan.mode.value} mode)")
        self._timeout = datetime.timedelta(seconds=response_timeout_s)

    def verify(self, requests: Sequence[VerifyRequest], params: Sequence[SamplingParams]) -> list[RoundOutcome]:
        """One round for every sequence: enqueue all, wait for all, derive each outcome."""
        if len(requests) != len(params):
            raise ValueError(f"{len(requests)} requests but {len(params)} SamplingParams")
        ids = self._executor.enqueue_requests([self._request(r, p) for r, p in zip(requests, params)])
        results = self._await(ids)
        outcomes = []
        for request_id, request in zip(ids, requests):
            result = results[request_id]
            reason = result.finish_reasons[0].name.lower()
            outcomes.append(derive_outcome(request.draft_tokens, result.output_token_ids[0], reason, request.end_id))
        return outcomes

    def _request(self, request: VerifyRequest, params: SamplingParams):
        drafts = None
        if request.draft_tokens:  # the config requires at least one token
            drafts = self._ex.ExternalDraftTokensConfig(list(request.draft_tokens), logits=request.draft_logits)
        return self._ex.Request(
            list(request.input_token_ids), max_tokens=request.max_tokens,
            sampling_config=self._ex.SamplingConfig(**sampling_config_fields(params)),
            output_config=self._ex.OutputConfig(exclude_input_from_output=True),
            end_id=request.end_id, external_draft_tokens_config=drafts,
        )

    def _await(self, ids: Sequence[int]) -> dict:
        """The final result of every request (non-streaming: one response each)."""
        results: dict = {}
        while len(results) < len(ids):
            responses = self._executor.await_responses(timeout=self._timeout)
            if not responses:
                raise TimeoutError(f"no TensorRT-LLM response within {self._timeout.total_seconds()} s")
            for response in responses:
                if response.has_error():
                    raise RuntimeError(f"TensorRT-LLM request {response.request_id} failed: {response.error_msg}")
                if response.result.is_final:
                    results[response.request_id] = response.result
        return results

    def shutdown(self) -> None:
        """Ends the engine's other ranks too: spawned workers (orchestrator) or followers (leader)."""
        self._executor.shutdown()


def serve_follower(engine_dir: str | Path, *, device_ids: Sequence[int] | None = None,
                   free_gpu_memory_fraction: float = 0.9) -> None:
    """Serve as engine rank 1..N-1 of an ``mpiexec -n N`` job in leader mode, until rank 0's
    executor shuts down. Every rank makes the Executor with the same configuration; a follower's
    ``shutdown`` returns once the leader's termination has reached its execution loop
    (``Executor::Impl::shutdown``). ``device_ids`` must be the leader's.

    unverified: never run (TensorRT-LLM cannot be installed where trtssd is developed).
    """
    if not tensorrt_llm_available():
        raise TensorRTLLMMissing(missing_message("A TensorRT-LLM engine rank"))
    plan = plan_for_engine(engine_dir, device_ids)
    if not plan.is_follower:
        raise ValueError(f"MPI rank {plan.rank} is not a follower ({plan.mode.value} mode, engine of "
                         f"{plan.world_size} rank(s)): followers are ranks 1..N-1 of an mpiexec -n N job")
    ex = import_tensorrt_llm("tensorrt_llm.bindings.executor", "A TensorRT-LLM engine rank")
    executor = ex.Executor(Path(engine_dir), ex.ModelType.DECODER_ONLY,
                           _executor_config(ex, plan, free_gpu_memory_fraction))
    log.info("TensorRT-LLM engine rank %d of %d serving until rank 0 shuts down", plan.rank, plan.world_size)
    executor.shutdown()


def _device_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--device-ids must be comma-separated integers; got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trtssd.trtllm.executor_target ENGINE_DIR``: an engine follower rank, started
    beside rank 0 in one MPMD job (docs/tensorrt_llm.md, Tensor parallelism)."""
    parser = argparse.ArgumentParser(prog="python -m trtssd.trtllm.executor_target",
                                     description="serve TensorRT-LLM engine ranks 1..N-1 in leader mode")
    parser.add_argument("engine_dir", help="the trtllm-build output rank 0 runs (its config.json and rank<r>.engine)")
    parser.add_argument("--device-ids", type=_device_list, default=None,
                        help="comma-separated GPU of each engine rank, as rank 0 has them (default: rank r on GPU r)")
    parser.add_argument("--free-gpu-memory-fraction", type=float, default=0.9,
                        help="KV cache share of free GPU memory, as rank 0 has it")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        serve_follower(args.engine_dir, device_ids=args.device_ids,
                       free_gpu_memory_fraction=args.free_gpu_memory_fraction)
    except (ValueError, TensorRTLLMMissing) as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
