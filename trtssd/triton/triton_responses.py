"""What goes back to Triton: the output arrays of one response (every output, every time, so a
client can read any of them from any response; the log-probability outputs only for a request
that set ``return_log_probs``, so the others pay nothing for them).

Streaming: one response per round with that round's new text and token ids, then a last one with
the finish reason and the request's speculation figures (its text is empty: the engine reports
the end after the last round's delta). Without streaming: one response with everything. A request
for several samples (``num_return_sequences``) gets these per sample, each response naming its
sample in ``sequence_index`` (TensorRT-LLM's), the samples' closing responses once all have ended.
``output_log_probs`` goes with ``output_ids`` (the values of this response's tokens) and
``cum_log_probs`` with ``num_output_tokens`` (the sum over all tokens so far).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trtssd.runtime.metrics import SpeculationMetrics


def output_arrays(text: str, token_ids: tuple[int, ...] | list[int], prompt_tokens: int, output_tokens: int,
                  finish_reason: str = "", spec: SpeculationMetrics | None = None, log_probs: Sequence[float] | None = None,
                  cum_log_prob: float = 0.0, sequence_index: int = 0) -> dict[str, np.ndarray]:
    """``output_tokens``: generated so far (by this sample); ``spec`` (the last response only): the
    request's speculation counters; ``log_probs`` (None: not asked for): one per token of
    ``token_ids``; ``cum_log_prob``: their sum over all tokens so far; ``sequence_index``: the
    sample the response is about."""
    spec = spec if spec is not None else SpeculationMetrics()
    rounds = spec.cache_hits + spec.cache_misses
    arrays = {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(token_ids, dtype=np.int32),
        "finish_reason": np.array([finish_reason.encode("utf-8")], dtype=np.object_),
        "sequence_index": np.array([sequence_index], dtype=np.int32),
        "num_input_tokens": np.array([prompt_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([output_tokens], dtype=np.uint32),
        "acceptance_rate": np.array([_ratio(spec.num_accepted_tokens, spec.num_draft_tokens)], dtype=np.float32),
        "total_accepted_draft_tokens": np.array([spec.num_accepted_tokens], dtype=np.int32),
        "total_draft_tokens": np.array([spec.num_draft_tokens], dtype=np.int32),
        "cache_hit_rate": np.array([_ratio(spec.cache_hits, rounds)], dtype=np.float32),
    }
    if log_probs is not None:
        if len(log_probs) != len(token_ids):
            raise ValueError(f"{len(log_probs)} log-probabilities for {len(token_ids)} tokens")
        # TensorRT-LLM's shapes less its batch dimension: [beams, tokens] and [beams], one beam.
        arrays["output_log_probs"] = np.array([list(log_probs)], dtype=np.float32)
        arrays["cum_log_probs"] = np.array([cum_log_prob], dtype=np.float32)
    return arrays


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
