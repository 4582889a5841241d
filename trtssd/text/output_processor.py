"""Text work on the target loop's token outputs, kept off the loop: detokenization, stop strings,
stream deltas, and the one record a finished request leaves.

The target loop emits token ids only, so text never costs the target's cores. `OutputText` turns
one sample's `StepOutput`s into `Delta`s (a request of ``SamplingParams.n`` samples has one per
sample, its deltas carrying the sample's ``index``). When a stop string completes, the delta is cut at the
token that completes it and carries ``stop_at``: the caller tells the loop (`TargetLoop.stop`),
which ends the sequence (the draft learns it from the release of its rows). The output is cut
here and only here: tokens the loop emitted meanwhile are dropped from the deltas and from the
record (`request_output`), so the output ends exactly at the stop. `LLM` runs this between
steps; a server runs it on its event loop's thread, beside HTTP, as vLLM's output processor does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence as Seq

from trtssd.text.detokenizer import IncrementalDetokenizer
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.runtime.sequence import Sequence, StepOutput
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
    index: int = 0  # the sample it belongs to (0..SamplingParams.n - 1)


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request (``SamplingParams.n`` of them): what it produced and why it ended."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length" or "abort"
    logprobs: list[TokenLogprob] | None = None  # one per token when SamplingParams.logprobs is set


@dataclass(frozen=True)
class RequestOutput:
    """The record of one finished request: what it produced and how long it took. Times are the
    target loop's (one clock): arrival when the request was made, first token when it was emitted.

    ``outputs`` holds every sample (`CompletionOutput`, index order; one for n = 1); the fields
    ``token_ids``, ``text``, ``finish_reason``, ``logprobs`` and ``token_gaps_s`` are sample 0's, so a
    one-sample request reads as it always did. ``speculation`` adds up every sample's counters,
    usage counts the prompt once and the completion tokens of every sample (as OpenAI's)."""

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
    outputs: tuple[CompletionOutput, ...] = ()  # every sample; () given: sample 0 alone, from the fields above

    def __post_init__(self) -> None:
        if not self.outputs:
            object.__setattr__(self, "outputs", (CompletionOutput(0, self.token_ids, self.text, self.finish_reason,
                                                                  self.logprobs),))

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

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

    def __init__(self, tokenizer, stop: Seq[str] = (), index: int = 0, min_tokens: int = 0):
        """min_tokens: stop strings count from the output's min_tokens-th token on (SamplingParams)."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, stop, min_tokens) if tokenizer is not None else None
        self.index = index  # the request's sample this text is (Delta.index)
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
                     self.stop_at, out.prompt_logprobs, self.index)


def request_output(samples: Seq[Sequence], texts: Seq[OutputText], prompt: Prompt | None = None) -> RequestOutput:
    """The record of a request whose samples (its sequences, in index order, one per text) the
    loop has finished, each cut where its text found a stop string (the loop may have emitted
    more before it learnt of the stop)."""
    outputs = tuple(_completion(seq, text) for seq, text in zip(samples, texts))
    seq = samples[0]
    speculation = SpeculationMetrics()
    for sample, out in zip(samples, outputs):  # each sample's tokens counted up to its cut
        speculation.merge(dataclasses.replace(sample.metrics, num_generated_tokens=len(out.token_ids)))
    firsts = [s.emit_times[0] for s in samples if s.emit_times]
    return RequestOutput(
        request_id=seq.request_id, prompt=list(seq.prompt) if prompt is None else prompt,
        prompt_token_ids=list(seq.prompt), token_ids=outputs[0].token_ids, text=outputs[0].text,
        finish_reason=outputs[0].finish_reason, speculation=speculation,
        ttft_s=min(firsts) - seq.arrival if firsts else None,
        e2e_s=max(s.finish_time for s in samples) - seq.arrival,
        token_gaps_s=tuple(b - a for a, b in zip(seq.emit_times, seq.emit_times[1:])),
        num_cached_tokens=seq.num_cached_tokens, logprobs=outputs[0].logprobs,
        prompt_logprobs=None if seq.prompt_logprobs is None else list(seq.prompt_logprobs), outputs=outputs)


def _completion(seq: Sequence, text: OutputText) -> CompletionOutput:
    n = text.stop_at if text.stop_at is not None else len(seq.output)
    return CompletionOutput(seq.sample_index, list(seq.output[:n]), text.text,
                            "stop" if text.stop_at is not None else seq.finish_reason,
                            None if seq.params.logprobs is None else list(seq.logprobs[:n]))
