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

Everything above the :class:`TrtllmTargetExecutor` class is plain logic with no TensorRT-LLM
import; the class itself is unverified: never run.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from trtssd.runtime import protocol as P
from trtssd.sampling import SamplingParams
from trtssd.trtllm.availability import import_tensorrt_llm

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


# -- the executor (TensorRT-LLM) ----------------------------------------------------------------


class TrtllmTargetExecutor:
    """Verification rounds on a TensorRT-LLM 1.2.x engine built with
    ``--speculative_decoding_mode draft_tokens_external`` (``trtssd build --backend trtllm``).

    unverified: never run. API from TensorRT-LLM's bindings (``cpp/tensorrt_llm/pybind/executor/
    bindings.cpp``, ``request.cpp``): ``Executor(model_path, model_type, executor_config)``,
    ``ExecutorConfig(max_beam_width, kv_cache_config=...)``, ``KvCacheConfig(enable_block_reuse,
    free_gpu_memory_fraction=...)``, ``Request(input_token_ids, *, max_tokens, sampling_config,
    output_config, end_id, external_draft_tokens_config)``, ``ExternalDraftTokensConfig(tokens,
    logits=None, acceptance_threshold=None)``, ``enqueue_requests`` / ``await_responses``.
    """

    def __init__(self, engine_dir: str | Path, *, free_gpu_memory_fraction: float = 0.9,
                 response_timeout_s: float = 60.0):
        self._ex = import_tensorrt_llm("tensorrt_llm.bindings.executor", "The TensorRT-LLM target executor")
        # Block reuse: every round re-submits the whole sequence as a new request; the cached
        # blocks of its prefix are found again instead of recomputed.
        kv_cache = self._ex.KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction=free_gpu_memory_fraction)
        config = self._ex.ExecutorConfig(1, kv_cache_config=kv_cache)  # beam width 1: speculation needs it
        self._executor = self._ex.Executor(Path(engine_dir), self._ex.ModelType.DECODER_ONLY, config)
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
        self._executor.shutdown()
