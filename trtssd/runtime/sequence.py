"""One request on the target rank (`Sequence`, its only record) and what a step emitted for it
(`StepOutput`). A sequence ends itself at a stop token or max_tokens (`Sequence.emit`); a stop
string is the output processor's (trtssd/text/output_processor.py), which cuts the output
where one completes."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from trtssd.runtime import protocol as P
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.sampling import History, SamplingParams, TokenLogprob
from trtssd.structured.grammar import GrammarState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one sequence: its new tokens."""

    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the request asked for them
    # On a sequence's first output only, when its request asked for them (Sequence.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Sequence:
    """One request, from admission to its end: the loop's record of it (and the only one)."""

    seq_id: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...] = ()  # the model's end tokens (a stop unless ignore_eos; min_tokens holds them back)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first None), when asked
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache gave (not prefilled)
    prefilled: int = 0  # prompt tokens in the target's KV (cached or prefilled)
    bonus: int | None = None  # last emitted token, not yet in the target's KV
    outcome: P.Outcome | None = None  # to report to the draft next round
    finish_reason: str | None = None
    metrics: SpeculationMetrics = field(default_factory=SpeculationMetrics)
    arrival: float = field(default_factory=time.perf_counter)  # when the request was made
    emit_times: list[float] = field(default_factory=list)  # when each emission of tokens happened
    finish_time: float | None = None
    on_draft: bool = False  # the draft rank knows this sequence
    draft_prefilled: int = 0  # prompt tokens sent to the draft's prefill (all of them: it can speculate)
    spec_streak: int = 0  # speculative rounds in a row (since admission or the last plain round)
    grammar: GrammarState | None = None  # a constrained request's grammar, after every emitted token
    sample_index: int = 0  # which of its request's SamplingParams.n samples this is
    # The sample whose prompt KV this one takes once that prompt is prefilled (samples 1..n-1 of
    # a request; None: this one prefills its prompt itself).
    fork_of: Sequence | None = None

    def history(self) -> History | None:
        """What comes before this sequence's next position (its prompt and output), where its
        params adjust the logits (penalties, logit_bias, bad words, min_tokens); else None."""
        return History(self.prompt, self.output, self.eos_token_ids) if self.params.adjusts_logits else None

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> StepOutput:
        """Append tokens up to the first stop token or max_tokens (nothing past it is emitted),
        with their logprobs when given; the output says which were kept."""
        params = self.params
        first = not self.emit_times  # the first output carries the prompt logprobs
        new: list[int] = []
        for tok in tokens:
            new.append(tok)
            if (not params.ignore_eos and tok in self.eos_token_ids) or tok in params.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.output) + len(new) >= params.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        self.output += new
        self.bonus = self.output[-1]
        if self.grammar is not None and self.grammar.advance(new) != len(new):
            # Every emitted token was sampled from a masked distribution: this is a bug.
            log.error("request %s: an emitted token is not allowed by its constraint; the mask is dropped",
                      self.request_id)
            self.grammar = None
        self.emit_times.append(time.perf_counter())
        self.metrics.num_generated_tokens = len(self.output)
        kept_logprobs = tuple(logprobs[:len(new)]) if logprobs is not None else ()
        self.logprobs += kept_logprobs
        return StepOutput(self.seq_id, new, self.finish_reason is not None, self.finish_reason, kept_logprobs,
                          self.prompt_logprobs if first else None)

    def finish_prompt_only(self) -> StepOutput:
        """A request with max_tokens 0 (scoring its prompt): done once prefilled, nothing sampled."""
        self.finish_reason = "length"
        self.emit_times.append(time.perf_counter())  # its answer (the prompt logprobs) goes out now
        return StepOutput(self.seq_id, [], True, "length", (), self.prompt_logprobs)
