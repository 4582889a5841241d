"""The target loop's queues, and what each step takes from them.

A request's `Sequence` goes waiting -> prefilling (admitted: its rows on the target, its cached
prompt prefix found, trtssd/runtime/prefix_cache.py) -> running (its prompt prefilled, its first
token emitted) -> finished; or it ends early (abort, a stop string). A request's SamplingParams.n
samples are n sequences admitted together: sample 0 prefills the prompt, the others take its KV
once it is in (`_fork`), so a prompt is prefilled once. Each step admits waiting
requests while the batch has room and takes the next piece of each admitted prompt within the
step's token budget (chunked prefill, ``prefill_chunk``), cut only where the executor can split
a prompt exactly (`PromptSplits`). A step whose prefill emitted first tokens owes the running
batch a round before any more prefill: prompts completing step after step (a burst of arrivals)
would otherwise hold every running stream for all of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from typing import Callable

import torch

from trtssd.backends.base import Chunk, Executor, chain_chunk
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.runtime.prefix_cache import PrefixCache
from trtssd.runtime.sequence import Sequence
from trtssd.sampling import FieldError, SamplingParams, make_generator, prompt_logprobs
from trtssd.structured.constraint import ConstraintError
from trtssd.structured.grammar import Grammars

Piece = tuple[Sequence, int]  # a sequence and where this step's piece of its prompt ends


class Scheduler:
    def __init__(self, target: Executor, honours: Callable[[SamplingParams], None], max_batch: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...], prefix_cache_seqs: int | None,
                 prefix_cache_mib: int | None, prefill_chunk: int, grammars: Grammars | None,
                 metrics: SpeculationMetrics):
        """honours: raises ValueError for sampling parameters the target's rounds cannot honour
        exactly (the loop's verifier's `check`). metrics: the loop's aggregate, which every
        sequence's counts join as it leaves."""
        if not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be a non-negative int; got {prefill_chunk!r}")
        self.target = target
        self.honours = honours
        self.max_batch = max_batch
        self.max_model_len = max_model_len  # prompt + output tokens per sequence, as the user set it
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars
        self.prefix_cache = PrefixCache(target, prefix_cache_seqs, prefix_cache_mib)
        self.prefill_chunk = prefill_chunk
        self.metrics = metrics
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, their prompts not all prefilled yet
        self.running: list[Sequence] = []
        self.finished: dict[int, Sequence] = {}
        self.released: list[int] = []  # sequences gone whose draft rows go with the next message to the draft
        self.round_owed = False  # the last step emitted first tokens instead of a round
        self._ids = itertools.count()

    # --- requests ----------------------------------------------------------------------------

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
                             f"max_model_len {self.max_model_len}: shorten the prompt or lower max_tokens")
        self.honours(params)
        if params.constraint is not None:
            if self.grammars is None:
                raise FieldError("constraint", "this model has no tokenizer: constraints cannot be served")
            try:
                self.grammars.check(params.constraint)  # compiled once per distinct constraint (cached)
            except ConstraintError as err:
                raise FieldError("constraint", str(err)) from None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def pop_finished(self, seq_id: int) -> Sequence | None:
        """A sequence the loop finished (it stays until popped), or None when it ended otherwise
        (`end`: its caller has it) or was popped already."""
        return self.finished.pop(seq_id, None)

    # --- a step's work -----------------------------------------------------------------------

    def admit(self) -> bool:
        """Waiting requests join while the batch has room, each with its cached prompt prefix; a
        request's samples join together (samples 1..n-1 get their rows now, their prompt's KV
        from sample 0 once it is prefilled). Returns whether any did."""
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
        return admitted

    def prefill_pieces(self) -> list[Piece]:
        """This step's prefill, in admission order, within the token budget; the first sequence
        always gets a piece, so every prompt progresses. A request asking for prompt logprobs is
        prefilled whole. (While a round is owed, only a round may carry them: TargetLoop.step.)"""
        left = self.prefill_chunk or float("inf")
        pieces: list[Piece] = []
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

    def prefill_groups(self, pieces: list[Piece]) -> list[list[Chunk]]:
        """Prompt pieces grouped so no forward exceeds the executor's token budget."""
        budget = self.target.capabilities.max_batch_tokens
        groups: list[list[Chunk]] = [[]]
        size = 0
        for s, end in pieces:
            if groups[-1] and size + end - s.prefilled > budget:
                groups.append([])
                size = 0
            # Prompt logprobs need every row's logits; the KV is the same either way (Chunk.prompt).
            chunk = chain_chunk(s.seq_id, s.prompt[s.prefilled:end], s.prefilled,
                                last_logits_only=s.params.prompt_logprobs is None)
            groups[-1].append(dataclasses.replace(chunk, prompt=True))
            size += end - s.prefilled
        return groups

    def prefilled(self, pieces: list[Piece], rows: list[torch.Tensor]) -> list[tuple[Sequence, torch.Tensor]]:
        """Commit this step's pieces (``rows``: each one's logits). Sequences whose prompt is all
        in join the running batch, each with the request's other samples (`_fork`; a prompt-only
        one leaves again when retired); returns them all with their prompt's logits."""
        done = []
        for (seq, end), r in zip(pieces, rows):
            self.target.commit(seq.seq_id, end - seq.prefilled)
            seq.prefilled = end
            if end == len(seq.prompt):
                done.append((seq, r))
        samples = []
        for seq, r in done:
            self.prefilling.remove(seq)
            self.prefix_cache.index(seq.seq_id, seq.prompt)
            if seq.params.prompt_logprobs is not None:
                seq.prompt_logprobs = prompt_logprobs(r, seq.prompt, seq.params, self.eos_token_ids)
            self.running.append(seq)
            samples += [(sample, r) for sample in (seq, *self._fork(seq))]  # each sample's first token from these logits
        return samples

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of the request whose sample 0 (``seq``) has just prefilled its prompt:
        each takes that prompt's KV (`Executor.share_prefix`: llama.cpp shares its cells, torch
        copies them) instead of prefilling it, and runs from now on (its first token is drawn
        from the same last logits). The draft forks them too (`TargetLoop._forks_on_draft`).
        Returns them."""
        forks = [s for s in self.prefilling if s.fork_of is seq]
        for fork in forks:
            self.prefilling.remove(fork)
            self.target.share_prefix(seq.seq_id, fork.seq_id, len(seq.prompt))
            fork.prefilled = fork.num_cached_tokens = len(fork.prompt)
            fork.prompt_logprobs = seq.prompt_logprobs
            self.running.append(fork)
        return forks

    def retire(self, round_owed: bool) -> list[Sequence]:
        """Finished sequences leave the running batch; ``round_owed``: this step emitted first
        tokens instead of a round, which the next step owes the running batch. Returns them."""
        done = [s for s in self.running if s.finish_reason is not None]
        self.running = [s for s in self.running if s.finish_reason is None]
        for seq in done:
            self._free(seq)
            self.finished[seq.seq_id] = seq
        self.round_owed = round_owed and bool(self.running)
        return done

    # --- the end of a sequence ---------------------------------------------------------------

    def end(self, seq_id: int, reason: str) -> Sequence | None:
        """Take a waiting or running sequence out now (its rows and counts as at its finish);
        returns it with ``reason`` as its finish reason, or None when it is neither waiting,
        prefilling nor running."""
        seq = next((s for s in (*self.waiting, *self.prefilling, *self.running) if s.seq_id == seq_id), None)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)  # never admitted: no rows anywhere
            seq.finish_time = time.perf_counter()
        else:
            (self.running if seq in self.running else self.prefilling).remove(seq)
            self._free(seq)
        self._hand_down(seq)
        seq.finish_reason = reason
        return seq

    def _hand_down(self, seq: Sequence) -> None:
        """A sample that ended before its prompt was prefilled (none waits for a running one's):
        the samples that were to take its prompt's KV take the next one's, which prefills it."""
        forks = [s for s in (*self.waiting, *self.prefilling) if s.fork_of is seq]
        for fork in forks:
            fork.fork_of = forks[0] if fork is not forks[0] else None

    def _free(self, seq: Sequence) -> None:
        """A sequence that left the running batch (or its prefill): its target rows go now, or
        stay in the prefix cache; the draft's go with the next message to the draft; its counts
        join the loop's."""
        seq.finish_time = time.perf_counter()
        self.prefix_cache.finish(seq.seq_id)
        if seq.on_draft:
            self.released.append(seq.seq_id)
        self.metrics.merge(seq.metrics, times=False)  # round times were added once per round

    def take_released(self) -> tuple[int, ...]:
        """The sequences whose draft rows are to be freed, handed to a message to the draft."""
        released, self.released = tuple(self.released), []
        return released
