"""Text work on the target loop's token outputs, kept off the loop: detokenization, stop strings,
stream deltas, and the one record a finished request leaves.

The target loop emits token ids only, so text never costs the target's cores. `OutputText` turns
one request's `StepOutput`s into `Delta`s. When a stop string completes, the delta is cut at the
token that completes it and carries ``stop_at``: the caller tells the loop (`TargetLoop.stop`),
which ends the sequence there (the draft learns it from the release of its rows). Tokens the loop
emitted meanwhile are dropped here, so the output still ends exactly at the stop. `LLM` runs this
between steps; a server runs it on its event loop's thread, beside HTTP, as vLLM's output
processor does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

from trtssd.runtime.detokenizer import IncrementalDetokenizer
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.runtime.target_loop import Sequence, StepOutput
from trtssd.sampling import TokenLogprob

Prompt = str | Seq[int]


@dataclass(frozen=True)
class Delta:
    """What one step added to one request's output."""

    token_ids: tuple[int, ...]
    text: str
    token_texts: tuple[str, ...]  # each token's share of ``text`` (for per-token streams)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked for them
    stop_at: int | None = None  # a stop string ends the output after this many tokens
    # On the request's first delta only, when it asked for them (SamplingParams.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """The record of one finished request: what it produced and how long it took. Times are the
    target loop's (one clock): arrival when the request was made, first token when it was emitted."""

    request_id: str
    prompt: Prompt  # as the caller gave it: text or token ids
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length" or "abort"
    speculation: SpeculationMetrics  # this request's speculation counters
    ttft_s: float | None  # arrival -> first token (None when aborted before it)
    e2e_s: float  # arrival -> finished
    token_gaps_s: tuple[float, ...]  # between successive emissions (inter-token latency)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)
    logprobs: list[TokenLogprob] | None = None  # one per token when SamplingParams.logprobs is set
    # One per prompt token, the first None (nothing scores it), when SamplingParams.prompt_logprobs is set.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    @property
    def metrics(self) -> dict:
        """The speculation summary with time to first token and end-to-end latency."""
        out = self.speculation.summary()
        out["ttft_s"] = None if self.ttft_s is None else round(self.ttft_s, 6)
        out["e2e_s"] = round(self.e2e_s, 6)
        return out


class OutputText:
    """One request's text: its tokens detokenized as the loop emits them, cut at the first stop
    string. Without a tokenizer the text stays empty and stop strings cannot apply."""

    def __init__(self, tokenizer, stop: Seq[str] = ()):
        self._detokenizer = IncrementalDetokenizer(tokenizer, stop) if tokenizer is not None else None
        self.num_tokens = 0  # tokens taken into the output
        self.stop_at: int | None = None  # set once a stop string ended the output

    @property
    def text(self) -> str:
        return self._detokenizer.text if self._detokenizer is not None else ""

    def add(self, out: StepOutput) -> Delta | None:
        """The delta of one step's output; None once a stop string has ended the output."""
        if self.stop_at is not None:
            return None
        detokenizer = self._detokenizer
        texts: list[str] = []
        for tok in out.new_token_ids:
            texts.append(detokenizer.add(tok) if detokenizer is not None else "")
            if detokenizer is not None and detokenizer.stop_string is not None:
                break
        self.num_tokens += len(texts)
        if detokenizer is not None:
            if out.finished and detokenizer.stop_string is None and texts:
                # The held-back text; a stop string may complete only with its incomplete character.
                texts[-1] += detokenizer.finish()
            if detokenizer.stop_string is not None:
                self.stop_at = self.num_tokens
        kept = len(texts)
        return Delta(tuple(out.new_token_ids[:kept]), "".join(texts), tuple(texts), tuple(out.logprobs[:kept]),
                     self.stop_at, out.prompt_logprobs)


def request_output(seq: Sequence, text: OutputText, prompt: Prompt | None = None) -> RequestOutput:
    """The record of a sequence the loop has finished, cut where its text found a stop string
    (the loop may have emitted more before it learnt of the stop)."""
    n = text.stop_at if text.stop_at is not None else len(seq.output)
    reason = "stop" if text.stop_at is not None else seq.finish_reason
    first = seq.emit_times[0] if seq.emit_times else None
    return RequestOutput(
        request_id=seq.request_id, prompt=list(seq.prompt) if prompt is None else prompt,
        prompt_token_ids=list(seq.prompt), token_ids=list(seq.output[:n]), text=text.text, finish_reason=reason,
        speculation=seq.metrics, ttft_s=None if first is None else first - seq.arrival,
        e2e_s=seq.finish_time - seq.arrival,
        token_gaps_s=tuple(b - a for a, b in zip(seq.emit_times, seq.emit_times[1:])),
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=None if seq.params.logprobs is None else list(seq.logprobs[:n]),
        prompt_logprobs=None if seq.prompt_logprobs is None else list(seq.prompt_logprobs))
