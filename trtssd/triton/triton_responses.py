"""What goes back to Triton: the output arrays of one response (every output, every time, so a
client can read any of them from any response).

Streaming: one response per round with that round's new text and token ids, then a last one with
the finish reason and the request's speculation figures (its text is empty: the engine reports
the end after the last round's delta). Without streaming: one response with everything.
"""

from __future__ import annotations

import numpy as np

from trtssd.runtime.metrics import SpecMetrics


def output_arrays(text: str, token_ids: tuple[int, ...] | list[int], prompt_tokens: int, output_tokens: int,
                  finish_reason: str = "", spec: SpecMetrics | None = None) -> dict[str, np.ndarray]:
    """``output_tokens``: generated so far; ``spec`` (the last response only): the request's
    speculation counters."""
    spec = spec if spec is not None else SpecMetrics()
    rounds = spec.cache_hits + spec.cache_misses
    return {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(token_ids, dtype=np.int32),
        "finish_reason": np.array([finish_reason.encode("utf-8")], dtype=np.object_),
        "num_input_tokens": np.array([prompt_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([output_tokens], dtype=np.uint32),
        "acceptance_rate": np.array([_ratio(spec.num_accepted_tokens, spec.num_draft_tokens)], dtype=np.float32),
        "total_accepted_draft_tokens": np.array([spec.num_accepted_tokens], dtype=np.int32),
        "total_draft_tokens": np.array([spec.num_draft_tokens], dtype=np.int32),
        "cache_hit_rate": np.array([_ratio(spec.cache_hits, rounds)], dtype=np.float32),
    }


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
