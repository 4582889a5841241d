"""The target loop's rounds on a TensorRT-LLM engine: a ``Verifier`` (trtssd/runtime/verifiers.py).

Each round every running sequence becomes one ``VerifyRequest`` (its whole sequence, ending with
the pending bonus, plus the draft rank's chain) and the executor's outcome becomes the loop's
accepted count and bonus; plain rounds (load control, a lost draft, ``ar`` mode) are requests
without drafts. The draft rank, its cache and the protocol are unchanged.

``TrtllmVerifier`` is plain logic over anything with ``TrtllmTargetExecutor.verify``'s signature,
tested with a stand-in executor; :func:`trtllm_verifier` makes one on a real engine and is
unverified: never run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, Sequence

import torch

from trtssd.runtime.sequence import Sequence as Row
from trtssd.runtime.verifiers import Verified
from trtssd.sampling import SamplingParams
from trtssd.trtllm.executor_target import (RoundOutcome, TrtllmTargetExecutor, VerifyRequest, build_verify_request,
                                          check_supported)

log = logging.getLogger(__name__)


class RoundExecutor(Protocol):
    """What the verifier needs of a TensorRT-LLM executor (``TrtllmTargetExecutor`` has it)."""

    def verify(self, requests: Sequence[VerifyRequest], params: Sequence[SamplingParams]) -> list[RoundOutcome]: ...


class TrtllmVerifier:
    """``Verifier`` backed by a TensorRT-LLM executor (or a stand-in with the same ``verify``).
    Prompts are prefilled on the loop's executor, never in its rounds."""

    carries_prompts = False

    def __init__(self, executor: RoundExecutor, vocab_size: int):
        self.executor = executor
        self.vocab_size = vocab_size

    def check(self, params: SamplingParams) -> None:
        check_supported(params)

    def close(self) -> None:
        """Shut the executor down (the stand-ins used in tests may have nothing to shut)."""
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def verify(self, seqs: list[Row], proposals: torch.Tensor, probs: torch.Tensor | None,
               point_mass: tuple[bool, ...], num_proposals: tuple[int, ...] | None = None,
               prompts: tuple = ()) -> Verified:
        _no_prompts(prompts)
        # Constrained requests are refused (check_supported), so every row verifies all K.
        rows = proposals.tolist()
        requests = [self._request(s, rows[i], None if probs is None else probs[i], point_mass[i])
                    for i, s in enumerate(seqs)]
        return self._run(seqs, requests)

    def plain(self, seqs: list[Row], prompts: tuple = ()) -> Verified:
        _no_prompts(prompts)
        return self._run(seqs, [self._request(s, [], None, False) for s in seqs])

    def _request(self, seq: Row, drafts: list[int], q_rows: torch.Tensor | None, point_mass: bool) -> VerifyRequest:
        # No end id: the loop applies stops itself (eos unless ignore_eos, stop ids, stop
        # strings), so TensorRT-LLM must keep going past them exactly as the torch target does.
        return build_verify_request(seq.prompt + seq.output, drafts, q_rows, point_mass, seq.params,
                                    seq.params.max_tokens - len(seq.output), self.vocab_size, end_id=None)

    def _run(self, seqs: list[Row], requests: list[VerifyRequest]) -> Verified:
        outcomes = self.executor.verify(requests, [s.params for s in seqs])
        accepted, bonus = [], []
        for seq, outcome in zip(seqs, outcomes):
            if outcome.bonus is None:  # only a stop ends a round without one, and none was asked for
                raise RuntimeError(f"sequence {seq.seq_id}: TensorRT-LLM stopped inside the drafts without an end id")
            accepted.append(outcome.num_accepted)
            bonus.append(outcome.bonus)
        return Verified(tuple(accepted), tuple(bonus))


def _no_prompts(prompts: tuple) -> None:
    if prompts:
        raise ValueError("TensorRT-LLM's rounds carry no prompt chunks (carries_prompts is False): "
                         "prompts are prefilled on the target loop's executor")


def trtllm_verifier(engine_dir: str | Path, vocab_size: int, tensor_parallel_size: int = 1) -> TrtllmVerifier:
    """A verifier on the TensorRT-LLM engine in ``engine_dir`` (built by
    ``trtssd build --backend trtllm``), whose tp_size must be ``tensor_parallel_size`` (an engine
    of T ranks is refused at 1, not run on one device). Raises TensorRTLLMMissing without
    ``tensorrt_llm``.

    unverified: never run (TensorRT-LLM cannot be installed where trtssd is developed).
    """
    if not Path(engine_dir).is_dir():
        raise ValueError(f"trtllm_engine_dir {str(engine_dir)!r} is not a directory")
    log.info("target rounds on the TensorRT-LLM engine %s", engine_dir)
    return TrtllmVerifier(TrtllmTargetExecutor(engine_dir, tensor_parallel_size=tensor_parallel_size), vocab_size)
