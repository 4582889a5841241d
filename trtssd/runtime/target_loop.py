"""The target rank: scheduling, speculate -> verify -> commit, and emission with stops.

The loop deals in token ids only: stops by token (EOS, stop_token_ids, max_tokens) end a sequence
here; text and stop strings are the output processor's (runtime/output_processor.py), which ends
a sequence through `stop` when a stop string completes.

Each step admits waiting requests and prefills their prompts (the draft prefills them in parallel;
a prompt's cached prefix is not prefilled again, trtssd/runtime/prefix_cache.py; a long prompt is
prefilled over several steps within a token budget, chunked prefill; a request's
SamplingParams.n samples are n sequences admitted together, sample 0 prefilling the prompt and the
others taking its KV, `_fork`, on the draft too), then runs one round for
every running sequence: in `ar` mode one target step; in `sd`/`ssd` mode it sends the
last outcomes to the draft, receives the speculation, verifies it in one K+1-token target pass
and commits the accepted tokens. The target's own state (committed KV plus the pending bonus
token) is always enough to continue alone, which is how a lost draft degrades to `ar` without
losing or corrupting anything.

Who scores the rows is a `Verifier`: by default `ExecutorVerifier`, the loop's own executor
(forward + `spec_decode.verify` + commit); another target engine (TensorRT-LLM, trtssd/trtllm/)
plugs in behind the same two calls. Prefill stays on the loop's executor either way.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from trtssd.backends.base import Executor, chain_chunk
from trtssd.config import Mode, SpeculativeConfig
from trtssd.runtime import protocol as P
from trtssd.runtime.draft_client import DraftClient
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.runtime.prefix_cache import PrefixCache
from trtssd.runtime.affinity import CoreLending, on_own_thread
from trtssd.runtime.round_choice import RoundChooser, speculation_ceiling
from trtssd.runtime.speculation_length import LengthChooser
from trtssd.runtime.speedup_model import CostCurve, StepCostModel, calibrated_forwards
from trtssd.runtime.transport import PeerLost
from trtssd.sampling import (FieldError, History, SamplingParams, TokenLogprob, greedy_tokens, make_generator,
                             processed_probs, prompt_logprobs, sample, token_logprobs)
from trtssd.spec_decode.backup import ngram_proposal
from trtssd.spec_decode.verify import verify
from trtssd.structured.constraint import ConstraintError
from trtssd.structured.grammar import GrammarState, Grammars, apply_bitmask, chain_bitmask

log = logging.getLogger(__name__)

STEADY_AFTER_ROUNDS = 2  # a row's first speculative rounds (after admission or plain ones) are transitional
CEILING_MAX_ROWS = 64  # the widest target forward timed for load control's ceiling (wider: extrapolated)


@dataclass
class Sequence:
    """One request, from admission to its end: the loop's record of it (and the only one)."""

    seq_id: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
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
    eos_token_ids: tuple[int, ...] = ()  # the model's end tokens (min_tokens holds them back)
    sample_index: int = 0  # which of its request's SamplingParams.n samples this is
    # The sample whose prompt KV this one takes once that prompt is prefilled (samples 1..n-1 of
    # a request; None: this one prefills its prompt itself).
    fork_of: Sequence | None = None

    def history(self) -> History | None:
        """What comes before this sequence's next position (its prompt and output), where its
        params adjust the logits (penalties, logit_bias, bad words, min_tokens); else None."""
        return History(self.prompt, self.output, self.eos_token_ids) if self.params.adjusts_logits else None


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


@dataclass(frozen=True)
class Verified:
    """Each row's verification result, in the order of the rows given."""

    num_accepted: tuple[int, ...]  # drafts accepted per row
    bonus: tuple[int, ...]  # the target's token after them per row
    # Per row, the logprobs of its accepted drafts and bonus where its SamplingParams.logprobs
    # asks for them, else None; empty when no row asks.
    logprobs: tuple[list[TokenLogprob] | None, ...] = ()


class Verifier(Protocol):
    """Scores the running rows on the target and returns what each one emits.

    Rows are `Sequence`s whose ``bonus`` is the pending token (not yet in the target's state);
    the verifier brings its target's state up to date with what it returns.
    """

    def verify(self, seqs: list[Sequence], proposals: torch.Tensor, probs: torch.Tensor | None,
               point_mass: tuple[bool, ...], num_proposals: tuple[int, ...] | None = None) -> Verified:
        """One speculative round: ``proposals`` [B, K] from the draft, ``probs`` its q' rows
        [B, K, V] (None for greedy rows), ``point_mass`` per row, ``num_proposals`` the
        proposals of each row to verify (its first ones; None: all K)."""

    def plain(self, seqs: list[Sequence]) -> Verified:
        """One plain step: a round without drafts (nothing accepted, each row's next token as
        its bonus)."""

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError for sampling parameters this target cannot honour exactly."""


class ExecutorVerifier:
    """The default verifier: the loop's own executor, one k+1-token pass, exact verification."""

    def __init__(self, target: Executor):
        self.target = target

    def check(self, params: SamplingParams) -> None:
        pass  # trtssd.sampling implements every SamplingParams field

    def verify(self, seqs: list[Sequence], proposals: torch.Tensor, probs: torch.Tensor | None,
               point_mass: tuple[bool, ...], num_proposals: tuple[int, ...] | None = None) -> Verified:
        # Each row [bonus, s_1..s_n] appended causally at its committed length.
        k = proposals.shape[1]
        counts = num_proposals if num_proposals is not None else (k,) * len(seqs)
        rows = [row[:n] for row, n in zip(proposals.tolist(), counts)]
        chunks = [chain_chunk(s.seq_id, [s.bonus] + rows[i], self.target.committed(s.seq_id))
                  for i, s in enumerate(seqs)]
        # [B, k+1, V]; a row with fewer proposals is padded (verify never reads past its count).
        logits = constrained(torch.stack([_padded(out, k + 1) for out in self.target.forward(chunks)]), seqs, rows)
        result = verify(
            logits, proposals.clone(), torch.tensor(counts, dtype=torch.long), probs,
            torch.tensor(point_mass, dtype=torch.bool), [s.params for s in seqs],
            [s.generator for s in seqs], [s.history() for s in seqs],
        )
        accepted, bonus = tuple(result.num_accepted.tolist()), tuple(result.bonus.tolist())
        for seq, n in zip(seqs, accepted):
            self.target.commit(seq.seq_id, n + 1)
        return Verified(accepted, bonus, _logprobs(seqs, logits, [rows[i][:n] + [b] for i, (n, b)
                                                                   in enumerate(zip(accepted, bonus))]))

    def plain(self, seqs: list[Sequence]) -> Verified:
        chunks = [chain_chunk(s.seq_id, [s.bonus], self.target.committed(s.seq_id)) for s in seqs]
        logits = constrained(torch.stack(self.target.forward(chunks)), seqs, [[] for _ in seqs])[:, 0]
        params, history = [s.params for s in seqs], [s.history() for s in seqs]
        if all(p.is_greedy for p in params):
            nxt = greedy_tokens(logits, params, history)  # what sampling the one-hot p would return
        else:
            nxt = sample(processed_probs(logits, params, history), [s.generator for s in seqs])
        for seq in seqs:
            self.target.commit(seq.seq_id, 1)
        tokens = tuple(nxt.tolist())
        return Verified((0,) * len(seqs), tokens, _logprobs(seqs, logits[:, None], [[t] for t in tokens]))


def constrained(logits: torch.Tensor, seqs: list[Sequence], chains: list[list[int]]) -> torch.Tensor:
    """Target logits [B, n, V] with each constrained row masked by its grammar: position i by the
    state after the row's emitted output and ``chains[b][:i]`` (its proposals before i), so p at
    every position of a verify chain is the masked distribution given its own prefix."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return logits
    t0 = time.perf_counter()
    n, vocab = logits.shape[1], logits.shape[2]
    out = torch.stack([apply_bitmask(logits[i], chain_bitmask(s.grammar, chains[i], n, vocab))
                       if s.grammar is not None else logits[i] for i, s in enumerate(seqs)])
    spent = (time.perf_counter() - t0) / len(rows)
    for i in rows:
        seqs[i].metrics.grammar_mask_time_s += spent
    return out


def _padded(logits: torch.Tensor, rows: int) -> torch.Tensor:
    """Logits [n, V] padded with zero rows to [rows, V]."""
    if logits.shape[0] == rows:
        return logits
    return torch.cat([logits, logits.new_zeros(rows - logits.shape[0], logits.shape[1])])


def _logprobs(seqs: list[Sequence], logits: torch.Tensor, emitted: list[list[int]]) -> tuple[list[TokenLogprob] | None, ...]:
    """Each row's emitted tokens' logprobs where its request asks for them (logits [B, n, V]
    score row b's emitted tokens at positions 0..), or () when no row does."""
    if all(s.params.logprobs is None for s in seqs):
        return ()
    return tuple(None if s.params.logprobs is None else
                 token_logprobs(logits[i, :len(emitted[i])], emitted[i], s.params, history=s.history())
                 for i, s in enumerate(seqs))


class TargetLoop:
    def __init__(self, target: Executor, spec: SpeculativeConfig, max_batch: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), draft: DraftClient | None = None,
                 verifier: Verifier | None = None, lending: CoreLending | None = None,
                 prefix_cache_seqs: int = 0, prefill_chunk: int = 0, grammars: Grammars | None = None):
        """prefix_cache_seqs: finished sequences whose prompt KV is kept for reuse (an executor
        that keeps them as sequences must hold max_batch + that many; llama.cpp's go to host
        memory). prefill_chunk: most prompt tokens prefilled per step (0: whole prompts).
        grammars: the target tokenizer's grammar compiler (None: constraints are refused)."""
        if spec.mode is not Mode.AR and draft is None:
            raise ValueError(f"mode {spec.mode.value!r} needs a draft rank")
        self.target = target
        self.spec = spec
        self.max_batch = max_batch
        self.max_model_len = max_model_len  # prompt + output tokens per sequence, as the user set it
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars
        self.draft = draft if spec.mode is not Mode.AR else None
        # Rounds after prefill; prefill itself always runs on ``target``.
        self.verifier = verifier if verifier is not None else ExecutorVerifier(target)
        if not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be a non-negative int; got {prefill_chunk!r}")
        self.prefix_cache = PrefixCache(target, prefix_cache_seqs)
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, their prompts not all prefilled yet
        self.running: list[Sequence] = []
        self.finished: dict[int, Sequence] = {}
        self.metrics = SpeculationMetrics()
        self._ids = itertools.count()
        self._round = 0
        self._released: list[int] = []
        self._last_verify_s = 0.0
        self._target_s: dict[int, float] | None = None  # the target's timed forwards, once
        self.lending = lending  # plain rounds (and prefill without a live draft) borrow the draft's cores
        ceiling = self._speculation_ceiling()
        self.chooser = RoundChooser(ceiling=ceiling, plain=self._plain_forecast() if ceiling else None)
        self.lengths = (LengthChooser(spec.k, self._verify_costs())
                        if spec.k_per_round and self.draft is not None else None)
        self._draft_busy_until = 0.0  # when the draft ends the pre-speculation it began after its last reply
        self._prefill_token_s = 0.0  # the target's last prefill, seconds per token (what the draft's costs at most)
        self._last_prespec_s = 0.0
        self._round_owed = False  # the last step emitted first tokens instead of a round

    def _speculation_ceiling(self):
        """What speculation can give at most (round_choice.speculation_ceiling), from the draft's
        calibrated forwards and the target's own, timed here on the target's cores. None where
        load control is off, the draft was not timed, or the target's rounds are not its forwards."""
        if not (self.spec.plain_under_load and self.draft is not None and self.draft.step_s
                and isinstance(self.verifier, ExecutorVerifier)):
            return None
        target_s = self._target_forwards()
        if target_s is None:
            return None  # load control then tries speculation
        return speculation_ceiling(CostCurve.from_mapping(self.draft.step_s, "draft forward seconds"),
                                   CostCurve.from_mapping(target_s, "target forward seconds"), self.spec.k)

    def _plain_forecast(self):
        """batch -> the tokens/s of plain rounds' forwards, timed here on the cores plain rounds
        run on (the draft's too, where it lends them; once per machine and model); None where that
        failed. Load control weighs it against the ceiling before plain rounds are measured."""
        rows = min(CEILING_MAX_ROWS, self.max_batch)
        try:
            if self.lending is None:
                timed = self._target_forwards()
            else:
                try:
                    timed = on_own_thread(lambda: self._time_plain_forwards(rows))
                finally:
                    self.lending.forget_threads()
        except Exception:  # noqa: BLE001 - an optimisation
            log.exception("timing the target's plain forwards failed")
            return None
        if not timed:
            return None
        curve = CostCurve.from_mapping(timed, "plain forward seconds")
        return lambda batch: batch / curve(batch)

    def _time_plain_forwards(self, rows: int) -> dict[int, float] | None:
        self.lending.for_round(plain=True)
        try:
            return calibrated_forwards(self.target, rows, side="target", plain_threads=self.lending.lent[1])
        finally:
            self.lending.for_round(plain=False)

    def _target_forwards(self) -> dict[int, float] | None:
        """The target's forward seconds by rows, timed here on the target's cores (once per
        machine and model); None where that failed."""
        if self._target_s is None:
            try:
                rows = min(CEILING_MAX_ROWS, self.max_batch * (self.spec.k + 1))
                self._target_s = calibrated_forwards(self.target, rows, side="target")
            except Exception:  # noqa: BLE001 - an optimisation
                log.exception("timing the target's forwards failed")
                return None
        return self._target_s

    def _verify_costs(self) -> StepCostModel:
        """K per round's verify seconds by rows: the timed forwards' shape where the loop's own
        executor verifies, else a linear prior; scaled by every verify observed."""
        costs = StepCostModel()
        timed = self._target_forwards() if isinstance(self.verifier, ExecutorVerifier) else None
        if timed:
            costs.calibrate(timed)
        return costs

    # --- requests ----------------------------------------------------------------------------

    def new_sequence(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """The record of a one-sample request (n = 1); `new_sequences` for any n."""
        if params.n != 1:
            raise ValueError(f"new_sequence makes one sample; use new_sequences for n = {params.n}")
        return self.new_sequences(prompt, params, request_id)[0]

    def new_sequences(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> list[Sequence]:
        """The records of a request's ``params.n`` samples, checked (`FieldError`) and stamped
        with its arrival; safe to call beside a running loop (it reads only fixed sizes). `add`
        queues them (together: they are admitted together). Sample j runs with
        ``params.for_sample(j)``; samples 1..n-1 take sample 0's prompt KV once it is prefilled
        (`_fork`), so the prompt is prefilled once."""
        self.check_request(prompt, params)
        first = self._sequence(prompt, params.for_sample(0), request_id, 0, None)
        rest = [self._sequence(prompt, params.for_sample(j), first.request_id, j, first) for j in range(1, params.n)]
        for seq in rest:
            seq.arrival = first.arrival
        return [first, *rest]

    def _sequence(self, prompt: list[int], params: SamplingParams, request_id: str | None, index: int,
                  fork_of: Sequence | None) -> Sequence:
        seq_id = next(self._ids)
        seq = Sequence(seq_id, request_id or f"req-{seq_id}", list(prompt), params, make_generator(params),
                       eos_token_ids=self.eos_token_ids, sample_index=index, fork_of=fork_of)
        if params.constraint is not None:
            seq.grammar = self.grammars.start(params.constraint)  # each sample its own grammar state
        return seq

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_request(self, prompt: list[int], params: SamplingParams) -> int:
        seq = self.new_sequence(prompt, params)
        self.add(seq)
        return seq.seq_id

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise `FieldError` if the request cannot be served (so a batch can be checked
        whole before any of it is queued)."""
        if not prompt:
            raise FieldError("prompt", "prompt must contain at least one token")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise FieldError("prompt", f"prompt token ids must be in [0, {self.target.vocab_size}); got {bad[:5]}")
        outside = params.vocabulary_errors(self.target.vocab_size)  # logit_bias and bad_words_ids
        if outside is not None:
            raise outside
        if params.n > self.max_batch:
            raise FieldError("n", f"n ({params.n}) exceeds max_batch {self.max_batch}: a request's samples run "
                                  "together in the running batch; lower n or raise max_batch")
        need = len(prompt) + params.max_tokens
        if need > self.max_model_len:
            # The prompt is at fault when it leaves no room for a single output token.
            raise FieldError("prompt" if len(prompt) >= self.max_model_len else "max_tokens",
                                 f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds "
                                 f"max_seq_len {self.max_model_len}: shorten the prompt or lower max_tokens")
        self.verifier.check(params)
        if params.constraint is not None:
            if self.grammars is None:
                raise FieldError("constraint", "this model has no tokenizer: constraints cannot be served")
            try:
                self.grammars.check(params.constraint)  # compiled once per distinct constraint (cached)
            except ConstraintError as err:
                raise FieldError("constraint", str(err)) from None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def speculating(self) -> bool:
        return self.draft is not None and self.draft.alive

    # --- the loop ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        self._admit()
        if self.prefilling and not self._round_owed:
            self._prefill(outputs)
            if outputs:
                # New requests' first tokens go out now: holding them for a whole speculative round
                # would add that round to their time to first token. The round comes next step,
                # before any more prefill: prompts completing step after step (a burst of arrivals)
                # would otherwise hold every running stream for all of them.
                self._retire()
                self._round_owed = bool(self.running)
                return outputs
        self._round_owed = False
        if self.running:
            if self.speculating and self._speculate_now():
                if self._draft_catches_up():
                    self._ar_round(outputs)  # while the draft prefills rows it has not seen
                else:
                    try:
                        self._speculative_round(outputs)
                    except PeerLost:
                        self._ar_round(outputs)  # the draft is gone: this round in ar, nothing lost
            else:
                self._ar_round(outputs)
        self._retire()
        return outputs

    def _admit(self) -> None:
        """Waiting requests join while the batch has room, each with its cached prompt prefix; a
        request's samples join together (samples 1..n-1 get their rows now, their prompt's KV
        from sample 0 once it is prefilled)."""
        admitted = False
        while self.waiting:
            seq = self.waiting[0]
            group = [seq, *(s for s in self.waiting if s.fork_of is seq)]
            if len(self.running) + len(self.prefilling) + len(group) > self.max_batch:
                break
            for s in group:
                self.waiting.remove(s)
            if seq.fork_of is not None and not any(s is seq.fork_of for s in self.prefilling):
                seq.fork_of = None  # its sample 0 is past its prefill (or gone): this one prefills itself
            # Prompt logprobs need every prompt row's logits: such a request prefills it all.
            reuse = (seq.params.prompt_logprobs is None and seq.fork_of is None
                     and self.prefix_cache.reuse_keeps_bits(seq.params))
            seq.prefilled = seq.num_cached_tokens = self.prefix_cache.start(seq.seq_id, seq.prompt, reuse=reuse)
            for fork in group[1:]:
                self.prefix_cache.start(fork.seq_id, fork.prompt, reuse=False)
            self.prefilling += group
            admitted = True
        if admitted:
            self._release_on_draft()  # before the draft must hold the new sequences

    def _prefill(self, outputs: list[StepOutput]) -> None:
        """One step's prefill: the next piece of each waiting prompt, within the step's token
        budget (``prefill_chunk``). A sequence whose prompt is all in goes to the running batch
        with its first token."""
        pieces = self._prefill_pieces()
        # The draft prefills beside the target: a sequence it was given its first piece of, or,
        # when its first piece is now, as load control expects speculation (_draft_prefills_now).
        to_draft = self.speculating and self._draft_prefills_now(len(self.running) + len(self.prefilling))
        sends = [s.draft_prefilled < end and (s.on_draft or (to_draft and s.prefilled == s.num_cached_tokens
                                                               and s.params.max_tokens > 0))
                 for s, end in pieces]
        self._take_cores(plain=not any(sends))
        for (seq, end), send in zip(pieces, sends):
            if send:
                self._prefill_on_draft(seq, end)
                self._forks_on_draft(seq)
        t0 = time.perf_counter()
        # Per piece, its logits: the last row only, or every row for prompt logprobs.
        rows = [r for group in self._prefill_groups(pieces) for r in self.target.forward(group)]
        now = time.perf_counter()
        self._prefill_token_s = (now - t0) / sum(end - s.prefilled for s, end in pieces)
        if any(sends):  # the draft prefills the same pieces, then pre-speculates first rounds
            self._draft_busy_until = max(self._draft_busy_until, now + max(now - t0, self._last_prespec_s))
        done = []
        for (seq, end), r in zip(pieces, rows):
            self.target.commit(seq.seq_id, end - seq.prefilled)
            seq.prefilled = end
            if end == len(seq.prompt):
                done.append((seq, r))
        generating = []
        for seq, r in done:
            self.prefilling.remove(seq)
            self.prefix_cache.index(seq.seq_id, seq.prompt)
            if seq.params.prompt_logprobs is not None:
                seq.prompt_logprobs = prompt_logprobs(r, seq.prompt, seq.params, self.eos_token_ids)
            self.running.append(seq)  # a prompt-only one leaves again at this step's _retire
            for sample in (seq, *self._fork(seq)):  # every sample's first token from the prompt's last logits
                if seq.params.max_tokens == 0:
                    self._finish_prompt_only(sample, outputs)
                else:
                    generating.append((sample, r[-1]))
        if generating:
            self._first_tokens([s for s, _ in generating], torch.stack([r for _, r in generating]), outputs)

    def _prefill_pieces(self) -> list[tuple[Sequence, int]]:
        """(sequence, prompt end) of this step's prefill, in admission order, within the token
        budget; the first sequence always gets a piece, so every prompt progresses. A piece ends
        where the executor can split a prompt exactly (`PromptSplits`); a request asking for
        prompt logprobs is prefilled whole."""
        left = self.prefill_chunk or float("inf")
        pieces: list[tuple[Sequence, int]] = []
        for seq in self.prefilling:
            if seq.fork_of is not None:
                continue  # its prompt's KV comes from its sample 0 (`_fork`)
            end = self._piece_end(seq, left, first=not pieces)
            if end is None:
                break
            pieces.append((seq, end))
            left -= end - seq.prefilled
            if left <= 0:
                break
        return pieces

    def _piece_end(self, seq: Sequence, left: float, first: bool) -> int | None:
        """Where this step's piece of a prompt ends: all of it if it fits the tokens ``left``,
        else the last exact split within them; None when nothing fits (the step's first piece
        is never None: at least the prompt's first exact split)."""
        start, length = seq.prefilled, len(seq.prompt)
        if length - start <= left:
            return length
        if seq.params.prompt_logprobs is not None:
            return length if first else None
        splits = self.target.capabilities.prompt_splits
        end = splits.last_split(start, int(start + left), length)
        if end is None and first:
            end = splits.next_split(start, length)
        return end

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of the request whose sample 0 (``seq``) has just prefilled its prompt:
        each takes that prompt's KV (`Executor.share_prefix`: llama.cpp shares its cells, torch
        copies them) instead of prefilling it, and runs from now on (its first token is drawn
        from the same last logits). The draft forks them too (`_forks_on_draft`). Returns them."""
        forks = [s for s in self.prefilling if s.fork_of is seq]
        for fork in forks:
            self.prefilling.remove(fork)
            self.target.share_prefix(seq.seq_id, fork.seq_id, len(seq.prompt))
            fork.prefilled = fork.num_cached_tokens = len(fork.prompt)
            fork.prompt_logprobs = seq.prompt_logprobs
            self.running.append(fork)
        return forks

    def _forks_on_draft(self, seq: Sequence) -> None:
        """Once the draft has been sent the whole prompt of a request's sample 0, its other samples
        follow right behind it: the draft forks them before it is idle (so its first-token guesses
        are made for them too). Samples the draft learns of later catch up in `_draft_catches_up`."""
        for fork in self.prefilling:
            if fork.fork_of is seq and not fork.on_draft and fork.params.max_tokens > 0 and self._draft_forks(fork):
                self._prefill_on_draft(fork, len(fork.prompt))

    def _draft_forks(self, seq: Sequence) -> bool:
        """Whether the draft can take this sample's prompt KV from its sample 0: it was sent the
        whole prompt, and has not been told to release it."""
        source = seq.fork_of
        return (source is not None and self.speculating and source.on_draft
                and source.draft_prefilled == len(source.prompt)
                and (source.finish_reason is None or source.seq_id in self._released))

    def _first_tokens(self, seqs: list[Sequence], logits: torch.Tensor, outputs: list[StepOutput]) -> None:
        """Sample and emit each new sequence's first token from its prompt's last logits [B, V]."""
        logits = constrained(logits[:, None], seqs, [[] for _ in seqs])[:, 0]
        p = processed_probs(logits, [s.params for s in seqs], [s.history() for s in seqs])
        first = sample(p, [s.generator for s in seqs]).tolist()
        logprobs = _logprobs(seqs, logits[:, None], [[t] for t in first])
        for i, (seq, tok) in enumerate(zip(seqs, first)):
            seq.outcome = P.Outcome(seq.seq_id, 0, tok)
            self._emit(seq, [tok], outputs, logprobs[i] if logprobs else None)

    def _finish_prompt_only(self, seq: Sequence, outputs: list[StepOutput]) -> None:
        """A request with max_tokens 0 (scoring its prompt): done once prefilled, nothing sampled."""
        seq.finish_reason = "length"
        seq.emit_times.append(time.perf_counter())  # its answer (the prompt logprobs) goes out now
        outputs.append(StepOutput(seq.seq_id, [], True, "length", (), seq.prompt_logprobs))

    def _draft_prefills_now(self, batch: int) -> bool:
        """Whether the draft prefills new sequences beside the target. Not where load control
        expects plain rounds at this batch size (decided there, borrowed from a neighbour, or its
        first try): the prefill then borrows the draft's cores, plain rounds are not held to the
        target's own cores while the draft prefills (under a stream of arrivals that halved them),
        and the draft learns of a sequence when it first speculates (its plain tokens are glued
        then)."""
        return not (self.spec.plain_under_load and self.chooser.expects_plain(batch))

    def _prefill_on_draft(self, seq: Sequence, upto: int) -> None:
        fork_of = seq.fork_of.seq_id if self._draft_forks(seq) else None
        seq.on_draft = self.draft.send(P.Prefill(seq.seq_id, tuple(seq.prompt), seq.params, upto, fork_of,
                                                 eos_token_ids=self.eos_token_ids))
        seq.draft_prefilled = upto

    def _draft_catches_up(self) -> bool:
        """Before speculating, the draft must hold every running row: rows admitted under plain
        rounds (load control) get their prompts' next pieces sent now, within the step's prefill
        budget (a whole prompt at once would hold the round for all of it on the draft). True
        while some row is still behind: this round is then decoded plainly. A seeded sampled row
        is never left behind: its seed promises the output of speculative rounds."""
        behind = [s for s in self.running if s.draft_prefilled < len(s.prompt)]
        left = float("inf") if self._seeded_sampling() or not self.prefill_chunk else self.prefill_chunk
        sent = 0
        for seq in behind:
            if self._draft_forks(seq):  # its sample 0's prompt is on the draft (sent before it in this loop)
                self._prefill_on_draft(seq, len(seq.prompt))
                continue
            if left <= 0:
                continue
            end = int(min(len(seq.prompt), seq.draft_prefilled + left))
            left -= end - seq.draft_prefilled
            sent += end - seq.draft_prefilled
            self._prefill_on_draft(seq, end)
        if sent:  # the draft's cores are busy with it: plain rounds meanwhile are not lent them
            self._draft_busy_until = max(self._draft_busy_until, time.perf_counter() + sent * self._prefill_token_s)
        return any(s.draft_prefilled < len(s.prompt) for s in behind)

    def _prefill_groups(self, pieces: list[tuple[Sequence, int]]) -> list[list]:
        """Prompt pieces grouped so no forward exceeds the executor's token budget."""
        budget = self.target.capabilities.max_batch_tokens
        groups, current, size = [], [], 0
        for s, end in pieces:
            n = end - s.prefilled
            if current and size + n > budget:
                groups.append(current)
                current, size = [], 0
            # Prompt logprobs need every row's logits; the KV is the same either way (Chunk.prompt).
            chunk = chain_chunk(s.seq_id, s.prompt[s.prefilled:end], s.prefilled,
                                last_logits_only=s.params.prompt_logprobs is None)
            current.append(dataclasses.replace(chunk, prompt=True))
            size += n
        groups.append(current)
        return groups

    def _take_cores(self, plain: bool) -> None:
        """The cores of the coming forwards: the draft's too for plain ones (if lent)."""
        if self.lending is not None:
            self.lending.for_round(plain)

    def _speculate_now(self) -> bool:
        """Load control (SpeculativeConfig.plain_under_load): speculate unless plain rounds have
        measured faster at this batch size. A seeded sampled row keeps the batch speculating:
        its seed promises the same output at any load."""
        return not self.spec.plain_under_load or self._seeded_sampling() or self.chooser.speculate(len(self.running))

    def _seeded_sampling(self) -> bool:
        return any(s.params.seeded_sampling for s in self.running)

    def _ar_round(self, outputs: list[StepOutput]) -> None:
        """One plain target step for every running row: chosen by load control while the draft
        is there (its rows catch up through the next outcome), or because the draft is lost. A
        constrained row whose grammar forces text verifies its forced tokens in the same forward
        (outside ar mode, whose rounds are the reference: one token per forward)."""
        t0, u0 = time.perf_counter(), self._upkeep_s()
        seqs = self.running
        chosen = self.speculating
        # Until the draft ends the pre-speculation of its last reply, its cores are busy: a round
        # that would borrow them runs on the target's own and is not the steady rate of plain rounds.
        steady = not chosen or self.lending is None or t0 >= self._draft_busy_until
        self._take_cores(plain=steady)
        self._release_on_draft()  # the draft waits for no round's request now
        forced = self._forced(seqs, self.spec.k) if self.spec.mode is not Mode.AR else [[] for _ in seqs]
        guess = [] if any(forced) else self._spare_row_guess(seqs)
        proposed = [guess] if guess else forced
        if any(proposed):  # the grammar's forced tokens or a guess, verified in this round's one forward
            result = self.verifier.verify(seqs, _proposal_tensor(proposed, self.spec.k), None, (True,) * len(seqs),
                                          tuple(len(f) for f in proposed))
        else:
            result = self.verifier.plain(seqs)
        total_emitted = 0
        for i, (seq, n, tok) in enumerate(zip(seqs, result.num_accepted, result.bonus)):
            seq.spec_streak = 0
            emitted = proposed[i][:n] + [tok]
            if chosen:
                seq.metrics.plain_rounds += 1
                seq.outcome = dataclasses.replace(seq.outcome, plain=seq.outcome.plain + tuple(emitted))
            elif self.spec.mode is not Mode.AR:
                seq.metrics.degraded_rounds += 1
            kept = self._emit(seq, emitted, outputs, result.logprobs[i] if result.logprobs else None)
            total_emitted += kept
            if forced[i]:
                seq.metrics.record_grammar_round(len(forced[i]), min(n, kept))
            elif guess:
                seq.metrics.record_guess(n > 0)
        if chosen:  # forced tokens count: load control weighs plain rounds by what they emit
            self.chooser.observe(False, len(seqs), total_emitted, self._round_s(t0, u0), steady=steady)

    def _spare_row_guess(self, seqs: list[Sequence]) -> list[int]:
        """An n-gram guess at a lone row's next token where the target's forward carries a spare
        row anyway (a ggml target pads a lone token over a long cache): verified as a point mass,
        it is free and exact. None in ar mode (its rounds are the reference), for a constrained row
        (its grammar decides) or a seeded sampled one (its seed promises the same draws at any
        load, and a verify draws differently from a plain step)."""
        if self.spec.mode is Mode.AR or len(seqs) != 1 or not self.target.spare_rows(1):
            return []
        seq = seqs[0]
        if seq.grammar is not None or seq.params.seeded_sampling:
            return []
        return ngram_proposal(seq.prompt + seq.output, 1)

    def _speculative_round(self, outputs: list[StepOutput]) -> None:
        seqs = [s for s in self.running if s.on_draft]
        if len(seqs) != len(self.running):
            raise PeerLost("some sequences are unknown to the draft")
        # A row's first speculative rounds (after admission or plain rounds) miss, glue, and
        # wait for pre-speculation to catch up: not the steady rate of speculation.
        steady = all(s.spec_streak >= STEADY_AFTER_ROUNDS for s in seqs)
        self._take_cores(plain=False)
        t0, u0 = time.perf_counter(), self._upkeep_s()
        buffer = self._round % 2
        req = P.SpeculateRequest(self._round, tuple(s.outcome for s in seqs), buffer, self._last_verify_s,
                                 tuple(self._released))
        self._released = []
        self._round += 1
        reply, tokens, probs = self.draft.speculate(req)
        if reply.round_id != req.round_id:
            self.draft.mark_dead(f"reply to round {reply.round_id} while waiting for round {req.round_id}")
            raise PeerLost("the draft answered another round")
        t1 = time.perf_counter()
        self._draft_busy_until = t1 + reply.prespec_time_s
        self._last_prespec_s = reply.prespec_time_s
        # K per round: the first k of the draft's K proposals (a prefix of a speculation is one).
        k = self.lengths.choose(len(seqs)) if self.lengths is not None else self.spec.k
        tokens, probs = tokens[:, :k], None if probs is None else probs[:, :k]
        tokens, point_mass, counts, forced = self._with_forced(seqs, tokens, reply.point_mass)
        result = self.verifier.verify(seqs, tokens, probs, point_mass, counts)
        t2 = time.perf_counter()
        self._last_verify_s = t2 - t1
        times = dict(verify_time_s=t2 - t1, draft_wait_time_s=t1 - t0, round_time_s=t2 - t0,
                     draft_answer_time_s=reply.answer_time_s, draft_prespec_time_s=reply.prespec_time_s)
        self.metrics.add_times(**times)
        accepted, bonus = result.num_accepted, result.bonus
        if self.lengths is not None:
            self.lengths.observe(k, list(accepted), len(seqs) * (k + 1), t2 - t1, t1 - t0)
        proposals = tokens.tolist()
        total_emitted = 0
        for i, seq in enumerate(seqs):
            n = accepted[i]
            verified = forced[i] or proposals[i]
            emitted = self._emit(seq, verified[:n] + [bonus[i]], outputs,
                                 result.logprobs[i] if result.logprobs else None)
            # Count only what was emitted: a stop inside the round cuts accepted tokens too.
            if forced[i]:
                seq.outcome = _grammar_outcome(seq.seq_id, forced[i][:n] + [bonus[i]], k)
                seq.metrics.record_grammar_round(len(forced[i]), min(n, emitted))
            else:
                seq.outcome = P.Outcome(seq.seq_id, n, bonus[i], num_drafts=k)
                seq.metrics.record_round(k, min(n, emitted), reply.sources[i])
            total_emitted += emitted
            seq.metrics.add_times(**times)
            seq.metrics.tree_branches += reply.tree_branches
            # The draft's lookup, counted beside its hits for the draft's hit rate (a request's
            # prompt once: samples 1..n-1 took it from sample 0, not from a lookup).
            if reply.cached_tokens and seq.fork_of is None:
                seq.metrics.draft_cached_tokens = reply.cached_tokens[i]
                seq.metrics.draft_prompt_tokens = len(seq.prompt)
            seq.spec_streak += 1
        self.chooser.observe(True, len(seqs), total_emitted, self._round_s(t0, u0), steady=steady)

    # --- structured outputs: the grammar's forced tokens as proposals ----------------------------

    def _forced(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        """Per row, the tokens its grammar forces after its pending bonus (at most k; empty for
        a free row or where the grammar leaves a choice)."""
        return [s.grammar.forced_tokens(k) if s.grammar is not None else [] for s in seqs]

    def _with_forced(self, seqs: list[Sequence], tokens: torch.Tensor, point_mass: tuple[bool, ...]):
        """The draft's proposals, with a constrained row's replaced by its grammar's forced tokens
        (verified as a point mass) where the draft's do not begin with them. Returns (proposals,
        point_mass, proposals per row, the forced tokens per row that replaced the draft's)."""
        k = tokens.shape[1]
        forced = self._forced(seqs, k)
        rows = tokens.tolist()
        replaced = [f if f and rows[i][:len(f)] != f else [] for i, f in enumerate(forced)]
        if not any(replaced):
            return tokens, point_mass, None, replaced
        # A new tensor: the draft's buffer stays as it wrote it.
        tokens = torch.where(torch.tensor([bool(f) for f in replaced])[:, None], _proposal_tensor(replaced, k), tokens)
        point_mass = tuple(pm or bool(f) for pm, f in zip(point_mass, replaced))
        return tokens, point_mass, tuple(len(f) if f else k for f in replaced), replaced

    def _upkeep_s(self) -> float:
        """The target's cache upkeep so far (a ggml compaction: GgmlExecutor.upkeep_s)."""
        return self.target.upkeep_s

    def _round_s(self, t0: float, upkeep0: float) -> float:
        """A round's seconds for load control, less cache upkeep paid within it: one compaction
        (up to ~0.1 s) in an 11 ms plain round would weigh in the running rate as if plain rounds
        had slowed eightfold, and make a speculation try look worth its seconds of catching up."""
        return time.perf_counter() - t0 - (self._upkeep_s() - upkeep0)

    # --- emission and stops ------------------------------------------------------------------

    def _emit(self, seq: Sequence, tokens: list[int], outputs: list[StepOutput],
              logprobs: list[TokenLogprob] | None = None) -> int:
        """Append tokens up to the first stop token or max_tokens (nothing past it is emitted),
        with their logprobs when given. Returns how many tokens were kept."""
        params = seq.params
        first = not seq.emit_times  # the first output carries the prompt logprobs
        new: list[int] = []
        for tok in tokens:
            new.append(tok)
            if (not params.ignore_eos and tok in self.eos_token_ids) or tok in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.output) + len(new) >= params.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        seq.output += new
        seq.bonus = seq.output[-1]
        if seq.grammar is not None and seq.grammar.advance(new) != len(new):
            # Every emitted token was sampled from a masked distribution: this is a bug.
            log.error("request %s: an emitted token is not allowed by its constraint; the mask is dropped",
                      seq.request_id)
            seq.grammar = None
        seq.emit_times.append(time.perf_counter())
        seq.metrics.num_generated_tokens = len(seq.output)
        kept_logprobs = tuple(logprobs[:len(new)]) if logprobs is not None else ()
        seq.logprobs += kept_logprobs
        outputs.append(StepOutput(seq.seq_id, new, seq.finish_reason is not None, seq.finish_reason, kept_logprobs,
                                  seq.prompt_logprobs if first else None))
        return len(new)

    def _retire(self) -> None:
        done = [s for s in self.running if s.finish_reason is not None]
        self.running = [s for s in self.running if s.finish_reason is None]
        for seq in done:
            self._free(seq)
            self.finished[seq.seq_id] = seq
        if done:
            self._release_if_idle()

    def _free(self, seq: Sequence) -> None:
        """A sequence that left the running batch (or its prefill): its target rows go now, or
        stay in the prefix cache; the draft's go with the next message to the draft; its counts
        join the loop's."""
        seq.finish_time = time.perf_counter()
        self.prefix_cache.finish(seq.seq_id)
        if seq.on_draft:
            self._released.append(seq.seq_id)
        self.metrics.merge(seq.metrics, times=False)  # round times were added once per round

    def _release_if_idle(self) -> None:
        if not self.has_unfinished():  # no round's request will carry them soon
            self._release_on_draft()

    def _release_on_draft(self) -> None:
        """Free the draft's rows of finished sequences now, not with the next round's request."""
        if self._released and self.speculating:
            self.draft.send(P.Release(tuple(self._released)))
            self._released = []

    def pop_finished(self, seq_id: int) -> Sequence:
        return self.finished.pop(seq_id)

    def abort(self, seq_id: int) -> Sequence | None:
        """End a waiting or running request now (its client went away). Call between steps.
        Returns the sequence (finish_reason "abort"), or None when it is neither waiting nor
        running."""
        return self._end(seq_id, "abort")

    def stop(self, seq_id: int, num_tokens: int) -> Sequence | None:
        """End a running request whose output a stop string ended after ``num_tokens`` tokens
        (the output processor found it): what the loop emitted past it is cut. Call between
        steps. Returns the sequence, or None when it has ended already."""
        seq = self._end(seq_id, "stop")
        if seq is not None:
            del seq.output[num_tokens:]
            del seq.logprobs[num_tokens:]
            seq.metrics.num_generated_tokens = len(seq.output)
        return seq

    def _end(self, seq_id: int, reason: str) -> Sequence | None:
        """Take a waiting or running sequence out now (`_free`: rows and counts)."""
        seq = next((s for s in self.waiting if s.seq_id == seq_id), None)
        if seq is not None:
            self.waiting.remove(seq)  # never admitted: no rows anywhere
            seq.finish_time = time.perf_counter()
            self._hand_down(seq)
        else:
            seq = next((s for s in self.running + self.prefilling if s.seq_id == seq_id), None)
            if seq is None:
                return None
            if seq in self.prefilling:
                self.prefilling.remove(seq)
                self._hand_down(seq)
            else:
                self.running.remove(seq)
            self._free(seq)
        seq.finish_reason = reason
        self._release_if_idle()
        return seq

    def _hand_down(self, seq: Sequence) -> None:
        """A sample that ended before its prompt was prefilled: the samples that were to take its
        prompt's KV take the next one's, which prefills the prompt itself."""
        forks = [s for s in (*self.waiting, *self.prefilling) if s.fork_of is seq]
        for fork in forks:
            fork.fork_of = forks[0] if fork is not forks[0] else None


def _proposal_tensor(rows: list[list[int]], k: int) -> torch.Tensor:
    """Proposal rows of up to k tokens as a [B, k] long tensor (zeros after each row's own)."""
    out = torch.zeros(len(rows), k, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row[:k], dtype=torch.long)
    return out


def _grammar_outcome(seq_id: int, emitted: list[int], k: int) -> P.Outcome:
    """What the draft learns of a round that verified the grammar's tokens, not its speculation:
    the emitted tokens, as a bonus (nothing of its speculation accepted) and plain tokens after."""
    return P.Outcome(seq_id, 0, emitted[0], plain=tuple(emitted[1:]), num_drafts=k, grammar=True)
