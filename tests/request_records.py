"""Finished-request records made by hand, for tests of what counts them (metrics)."""

from __future__ import annotations

from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.text.output_processor import RequestOutput


def finished(request_id: str, prompt_tokens: int, token_ids: tuple[int, ...], text: str, finish_reason: str,
             ttft_s: float | None, e2e_s: float, token_gaps_s: tuple[float, ...], spec: SpeculationMetrics) -> RequestOutput:
    prompt = list(range(prompt_tokens))
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt, token_ids=list(token_ids),
                         text=text, finish_reason=finish_reason, speculation=spec, ttft_s=ttft_s, e2e_s=e2e_s,
                         token_gaps_s=token_gaps_s)
