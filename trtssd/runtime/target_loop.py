"""The target rank's loop: schedule -> decide -> run -> observe, one step at a time.

Each step takes from the `Scheduler` (runtime/scheduler.py) the requests it admits and the
pieces of their prompts it prefills (the draft prefills them beside the target), then runs one
round for every running sequence, as the `RoundPolicy` (runtime/round_policy.py) decides: a
plain round (one target step; always in `ar` mode) or a speculative one (send the last outcomes
to the draft, receive the speculation, have a `Verifier` (runtime/verifiers.py) verify it in one
k+1-token target pass). The target's own state (committed KV plus the pending bonus token) is
always enough to continue alone: a lost draft degrades to `ar` without losing anything.

The loop deals in token ids only: text and stop strings are the output processor's
(trtssd/text/output_processor.py), which ends a sequence a stop string ends through `stop`.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from trtssd.backends.base import Executor
from trtssd.config import Mode, SpeculativeConfig
from trtssd.runtime import protocol as P
from trtssd.runtime.core_lending import CoreLending
from trtssd.runtime.draft_client import DraftClient
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.runtime.round_policy import RoundPolicy, RoundReport, TargetCosts
from trtssd.runtime.scheduler import Piece, Scheduler
from trtssd.runtime.sequence import Sequence, StepOutput
from trtssd.runtime.transport import PeerLost
from trtssd.runtime.verifiers import ExecutorVerifier, Verifier, constrained, emitted_logprobs
from trtssd.sampling import SamplingParams, processed_probs, sample
from trtssd.spec_decode.backup import ngram_proposal
from trtssd.structured.grammar import Grammars


class TargetLoop:
    def __init__(self, target: Executor, spec: SpeculativeConfig, max_batch: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), draft: DraftClient | None = None,
                 verifier: Verifier | None = None, lending: CoreLending | None = None,
                 prefix_cache_seqs: int | None = 0, prefix_cache_mib: int | None = None, prefill_chunk: int = 0,
                 grammars: Grammars | None = None,
                 costs: TargetCosts = TargetCosts()):
        """prefix_cache_seqs, prefix_cache_mib: finished sequences whose prompt KV is kept for
        reuse, and the host memory they may take where the executor saves them there (llama.cpp);
        None: no limit of its own (an executor keeping them as sequences holds those it has room
        for). prefill_chunk: most prompt tokens prefilled per step (0: whole prompts).
        grammars: the target tokenizer's grammar compiler (None: constraints are refused).
        lending, costs: the round policy's cores and calibrated forwards (`calibrate_target`,
        which the launcher calls: constructing a loop times nothing and writes nothing)."""
        if spec.mode is not Mode.AR and draft is None:
            raise ValueError(f"mode {spec.mode.value!r} needs a draft rank")
        self.target = target
        self.spec = spec
        self.draft = draft if spec.mode is not Mode.AR else None
        # Rounds after prefill; prefill itself always runs on ``target``.
        self.verifier = verifier if verifier is not None else ExecutorVerifier(target)
        self.metrics = SpeculationMetrics()
        # The loop's verifier at the time of each request (a caller may swap it).
        self.scheduler = Scheduler(target, lambda params: self.verifier.check(params), max_batch, max_model_len,
                                   eos_token_ids, prefix_cache_seqs, prefix_cache_mib, prefill_chunk, grammars,
                                   self.metrics)
        self.policy = RoundPolicy(spec, lending, costs, self.draft.step_s if self.draft is not None else None)
        self._round = 0
        self._last_verify_s = 0.0

    # --- requests (the scheduler's; safe to call beside a running loop where it says so) ------

    def new_sequence(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """The record of a one-sample request (n = 1); `new_sequences` for any n."""
        if params.n != 1:
            raise ValueError(f"new_sequence makes one sample; use new_sequences for n = {params.n}")
        return self.scheduler.new_sequences(prompt, params, request_id)[0]

    def new_sequences(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> list[Sequence]:
        return self.scheduler.new_sequences(prompt, params, request_id)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_finished(self, seq_id: int) -> Sequence | None:
        return self.scheduler.pop_finished(seq_id)

    def abort(self, seq_id: int) -> Sequence | None:
        """End a waiting or running request now (its client went away). Call between steps.
        Returns the sequence (finish_reason "abort"), or None when it has ended already."""
        return self._end(seq_id, "abort")

    def stop(self, seq_id: int) -> Sequence | None:
        """End a running request a stop string ended (the output processor found it and cuts
        its output there). Call between steps. Returns the sequence (finish_reason "stop"), or
        None when it has ended already."""
        return self._end(seq_id, "stop")

    @property
    def speculating(self) -> bool:
        return self.draft is not None and self.draft.alive

    # --- the loop ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Schedule (admit, pieces) -> decide -> run -> observe. A plain round carries the step's
        prompt pieces in its forward (`_carries`). Otherwise they are prefilled first, and new
        requests' first tokens go out at once: the round comes next step, before any prefill of
        its own (it may carry the next pieces)."""
        outputs: list[StepOutput] = []
        pieces = self._schedule()
        rows = list(self.scheduler.running)
        carried = pieces if rows and pieces and self._carries(rows, pieces) else []
        alone = [] if carried or self.scheduler.round_owed else pieces
        first_tokens = self._prefill(alone, outputs) if alone else False
        if rows and not first_tokens:
            self.policy.observe(self._run(rows, not carried and self._decide(rows), outputs, carried))
        if self.scheduler.retire(round_owed=first_tokens):
            self._release_if_idle()
        return outputs

    def _schedule(self) -> list[Piece]:
        """Admit waiting requests; this step's prompt pieces."""
        if self.scheduler.admit():
            self._release_on_draft()  # before the draft must hold the new sequences
        return self.scheduler.prefill_pieces()

    def _decide(self, rows: list[Sequence]) -> bool:
        """Whether this round speculates: with a live draft, as the round policy says, once the
        draft holds every row (until then it catches up, and the round is plain)."""
        return self.speculating and self.policy.speculate(rows) and not self._draft_catches_up(rows)

    def _carries(self, rows: list[Sequence], pieces: list[Piece]) -> bool:
        """Whether this step's prompt pieces go into the round's forward, as llama-server batches
        them (the executor keeps every row exact in any mix): where the round will be plain (ar
        mode, no live draft, or load control expects plain rounds at this batch), the loop's
        own executor verifies it, one forward holds the pieces beside the rows, and the draft
        prefills none of them (it would take its cores back from the round)."""
        if not self.verifier.carries_prompts or (self.speculating and not self.policy.expects_plain(rows)):
            return False
        tokens = sum(end - s.prefilled for s, end in pieces) + len(rows) * (self.spec.k + 1)
        return tokens <= self.target.capabilities.max_batch_tokens and not any(self._draft_sends(pieces))

    def _run(self, rows: list[Sequence], speculate: bool, outputs: list[StepOutput],
             pieces: list[Piece]) -> RoundReport | None:
        if speculate:
            try:
                return self._speculative_round(rows, outputs)
            except PeerLost:
                pass  # the draft is gone: this round in ar, nothing lost
        return self._plain_round(rows, outputs, pieces)

    # --- prefill -----------------------------------------------------------------------------

    def _prefill(self, pieces: list[Piece], outputs: list[StepOutput]) -> bool:
        """One step's prefill of ``pieces`` in forwards of their own. Returns whether some
        sequence's prompt is all in (`_prompts_in`)."""
        sends = self._draft_sends(pieces)
        self.policy.take_cores(plain=not any(sends))
        for (seq, end), send in zip(pieces, sends):
            if send:
                self._prefill_on_draft(seq, end)
                self._forks_on_draft(seq)
        t0 = time.perf_counter()
        # Per piece, its logits: the last row only, or every row for prompt logprobs.
        logits = [r for group in self.scheduler.prefill_groups(pieces) for r in self.target.forward(group)]
        now = time.perf_counter()
        self.policy.prefilled(now - t0, sum(end - s.prefilled for s, end in pieces), now, on_draft=any(sends))
        return self._prompts_in(pieces, logits, outputs)

    def _draft_sends(self, pieces: list[Piece]) -> list[bool]:
        """Per piece, whether the draft prefills it beside the target: a sequence it was given its
        first piece of, or, when its first piece is now, as load control expects speculation
        (draft_prefills_now)."""
        sched = self.scheduler
        to_draft = self.speculating and self.policy.draft_prefills_now(len(sched.running) + len(sched.prefilling))
        return [s.draft_prefilled < end and (s.on_draft or (to_draft and s.prefilled == s.num_cached_tokens
                                                            and s.params.max_tokens > 0))
                for s, end in pieces]

    def _prompts_in(self, pieces: list[Piece], logits: list[torch.Tensor] | tuple[torch.Tensor, ...],
                    outputs: list[StepOutput]) -> bool:
        """Commit the step's prefilled ``pieces`` (``logits``: each one's). A sequence whose
        prompt is all in joins the running batch with its first token (which goes out now).
        Returns whether any did."""
        done = self.scheduler.prefilled(pieces, list(logits))
        outputs += [seq.finish_prompt_only() for seq, _ in done if seq.params.max_tokens == 0]
        generating = [(seq, r[-1]) for seq, r in done if seq.params.max_tokens > 0]
        if generating:
            self._first_tokens([s for s, _ in generating], torch.stack([r for _, r in generating]), outputs)
        return bool(done)

    def _first_tokens(self, seqs: list[Sequence], logits: torch.Tensor, outputs: list[StepOutput]) -> None:
        """Sample and emit each new sequence's first token from its prompt's last logits [B, V]."""
        logits = constrained(logits[:, None], seqs, [[] for _ in seqs])[:, 0]
        p = processed_probs(logits, [s.params for s in seqs], [s.history() for s in seqs])
        first = sample(p, [s.generator for s in seqs]).tolist()
        logprobs = emitted_logprobs(seqs, logits[:, None], [[t] for t in first])
        for i, (seq, tok) in enumerate(zip(seqs, first)):
            seq.outcome = P.Outcome(seq.seq_id, 0, tok)
            outputs.append(seq.emit([tok], logprobs[i] if logprobs else None))

    def _prefill_on_draft(self, seq: Sequence, upto: int) -> None:
        fork_of = seq.fork_of.seq_id if self._draft_forks(seq) else None
        seq.on_draft = self.draft.send(P.Prefill(seq.seq_id, tuple(seq.prompt), seq.params, upto, fork_of,
                                                 eos_token_ids=seq.eos_token_ids))
        seq.draft_prefilled = upto

    def _forks_on_draft(self, seq: Sequence) -> None:
        """Once the draft has been sent the whole prompt of a request's sample 0, its other samples
        follow right behind it: the draft forks them before it is idle (so its first-token guesses
        are made for them too). Samples the draft learns of later catch up in `_draft_catches_up`."""
        for fork in self.scheduler.prefilling:
            if fork.fork_of is seq and not fork.on_draft and fork.params.max_tokens > 0 and self._draft_forks(fork):
                self._prefill_on_draft(fork, len(fork.prompt))

    def _draft_forks(self, seq: Sequence) -> bool:
        """Whether the draft can take this sample's prompt KV from its sample 0: it was sent the
        whole prompt, and has not been told to release it."""
        source = seq.fork_of
        return (source is not None and self.speculating and source.on_draft
                and source.draft_prefilled == len(source.prompt)
                and (source.finish_reason is None or source.seq_id in self.scheduler.released))

    def _draft_catches_up(self, rows: list[Sequence]) -> bool:
        """Before speculating, the draft must hold every running row: rows admitted under plain
        rounds (load control) get their prompts' next pieces sent now, within the step's prefill
        budget (a whole prompt at once would hold the round for all of it on the draft). True
        while some row is still behind: this round is then decoded plainly."""
        behind = [s for s in rows if s.draft_prefilled < len(s.prompt)]
        left = self.policy.catch_up_tokens(rows, self.scheduler.prefill_chunk)
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
            self.policy.draft_catching_up(sent)
        return any(s.draft_prefilled < len(s.prompt) for s in behind)

    # --- rounds ------------------------------------------------------------------------------

    def _plain_round(self, seqs: list[Sequence], outputs: list[StepOutput], pieces: list[Piece]) -> RoundReport | None:
        """One plain target step for every running row: chosen while the draft is there (load
        control, or while it catches up; its rows catch up through the next outcome), or because
        the draft is lost. A constrained row whose grammar forces text verifies its forced tokens
        in the same forward (outside ar mode, whose rounds are the reference: one token per
        forward), and so do ``pieces`` of prompts (`_carries`). Returns what the policy learns
        from it (None without a live draft; a round that prefilled too is not plain rounds' rate)."""
        t0, u0 = time.perf_counter(), self.target.upkeep_s
        chosen = self.speculating
        steady = self.policy.start_plain_round(chosen, t0) and not pieces
        self._release_on_draft()  # the draft waits for no round's request now
        forced = self._forced(seqs, self.spec.k) if self.spec.mode is not Mode.AR else [[] for _ in seqs]
        guess = [] if any(forced) or pieces else self._spare_row_guess(seqs)
        proposed = [guess] if guess else forced
        prompts = tuple(c for group in self.scheduler.prefill_groups(pieces) for c in group) if pieces else ()
        if any(proposed):  # the grammar's forced tokens or a guess, verified in this round's one forward
            result = self.verifier.verify(seqs, _proposal_tensor(proposed, self.spec.k), None, (True,) * len(seqs),
                                          tuple(len(f) for f in proposed), prompts=prompts)
        else:
            result = self.verifier.plain(seqs, prompts=prompts)
        if pieces:  # a token of the round's forward costs about what a prompt token does
            now = time.perf_counter()
            self.policy.prefilled(now - t0, sum(end - s.prefilled for s, end in pieces) + len(seqs), now, on_draft=False)
        total_emitted = 0
        for i, (seq, n, tok) in enumerate(zip(seqs, result.num_accepted, result.bonus)):
            seq.spec_streak = 0
            emitted = proposed[i][:n] + [tok]
            if chosen:
                seq.metrics.plain_rounds += 1
                seq.outcome = dataclasses.replace(seq.outcome, plain=seq.outcome.plain + tuple(emitted))
            elif self.spec.mode is not Mode.AR:
                seq.metrics.degraded_rounds += 1
            out = seq.emit(emitted, result.logprobs[i] if result.logprobs else None)
            outputs.append(out)
            kept = len(out.new_token_ids)
            total_emitted += kept
            if forced[i]:
                seq.metrics.record_grammar_round(len(forced[i]), min(n, kept))
            elif guess:
                seq.metrics.record_guess(n > 0)
        if pieces:
            self._prompts_in(pieces, result.prompt_logits, outputs)
        if not chosen:
            return None
        return RoundReport(False, len(seqs), total_emitted, self._round_s(t0, u0), steady)

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

    def _speculative_round(self, rows: list[Sequence], outputs: list[StepOutput]) -> RoundReport:
        seqs = [s for s in rows if s.on_draft]
        if len(seqs) != len(rows):
            raise PeerLost("some sequences are unknown to the draft")
        steady = self.policy.start_speculative_round(seqs)
        t0, u0 = time.perf_counter(), self.target.upkeep_s
        req = P.SpeculateRequest(self._round, tuple(s.outcome for s in seqs), self._round % 2, self._last_verify_s,
                                 self.scheduler.take_released())
        self._round += 1
        reply, tokens, probs = self.draft.speculate(req)
        if reply.round_id != req.round_id:
            self.draft.mark_dead(f"reply to round {reply.round_id} while waiting for round {req.round_id}")
            raise PeerLost("the draft answered another round")
        t1 = time.perf_counter()
        self.policy.draft_replied(t1, reply.prespec_time_s)
        # K per round: the first k of the draft's K proposals (a prefix of a speculation is one).
        k = self.policy.k(len(seqs))
        tokens, probs = tokens[:, :k], None if probs is None else probs[:, :k]
        tokens, point_mass, counts, forced = self._with_forced(seqs, tokens, reply.point_mass)
        result = self.verifier.verify(seqs, tokens, probs, point_mass, counts)
        t2 = time.perf_counter()
        self._last_verify_s = t2 - t1
        times = dict(verify_time_s=t2 - t1, draft_wait_time_s=t1 - t0, round_time_s=t2 - t0,
                     draft_answer_time_s=reply.answer_time_s, draft_prespec_time_s=reply.prespec_time_s)
        self.metrics.add_times(**times)
        emitted = self._commit_speculation(seqs, tokens.tolist(), forced, result, reply, k, outputs)
        for seq in seqs:
            seq.metrics.add_times(**times)
        return RoundReport(True, len(seqs), emitted, self._round_s(t0, u0), steady, k, result.num_accepted,
                           t2 - t1, t1 - t0)

    def _commit_speculation(self, seqs: list[Sequence], proposals: list[list[int]], forced: list[list[int]],
                            result, reply: P.SpeculateReply, k: int, outputs: list[StepOutput]) -> int:
        """Emit each row's accepted proposals and bonus, record the round, and keep the outcome
        the draft learns next round. Returns the tokens emitted."""
        total_emitted = 0
        for i, seq in enumerate(seqs):
            n, bonus = result.num_accepted[i], result.bonus[i]
            tokens = (forced[i] or proposals[i])[:n] + [bonus]
            out = seq.emit(tokens, result.logprobs[i] if result.logprobs else None)
            outputs.append(out)
            # Count only what was emitted: a stop inside the round cuts accepted tokens too.
            emitted = len(out.new_token_ids)
            if forced[i]:  # the draft learns the tokens as a bonus (none of its speculation) and plain ones
                seq.outcome = P.Outcome(seq.seq_id, 0, tokens[0], plain=tuple(tokens[1:]), num_drafts=k, grammar=True)
                seq.metrics.record_grammar_round(len(forced[i]), min(n, emitted))
            else:
                seq.outcome = P.Outcome(seq.seq_id, n, bonus, num_drafts=k)
                seq.metrics.record_round(k, min(n, emitted), reply.sources[i])
            total_emitted += emitted
            seq.metrics.tree_branches += reply.tree_branches
            # The draft's lookup, counted beside its hits for the draft's hit rate (a request's
            # prompt once: samples 1..n-1 took it from sample 0, not from a lookup).
            if reply.cached_tokens and seq.fork_of is None:
                seq.metrics.draft_cached_tokens = reply.cached_tokens[i]
                seq.metrics.draft_prompt_tokens = len(seq.prompt)
            seq.spec_streak += 1
        return total_emitted

    def _round_s(self, t0: float, upkeep0: float) -> float:
        """A round's seconds for load control, less cache upkeep paid within it: one compaction
        (up to ~0.1 s) in an 11 ms plain round would weigh in the running rate as if plain rounds
        had slowed eightfold, and make a speculation try look worth its seconds of catching up."""
        return time.perf_counter() - t0 - (self.target.upkeep_s - upkeep0)

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

    # --- the draft's rows of sequences gone, and ending a sequence early ------------------------

    def _release_if_idle(self) -> None:
        if not self.has_unfinished():  # no round's request will carry them soon
            self._release_on_draft()

    def _release_on_draft(self) -> None:
        """Free the draft's rows of finished sequences now, not with the next round's request."""
        if self.scheduler.released and self.speculating:
            self.draft.send(P.Release(self.scheduler.take_released()))

    def _end(self, seq_id: int, reason: str) -> Sequence | None:
        seq = self.scheduler.end(seq_id, reason)
        if seq is not None:
            self._release_if_idle()
        return seq


def _proposal_tensor(rows: list[list[int]], k: int) -> torch.Tensor:
    """Proposal rows of up to k tokens as a [B, k] long tensor (zeros after each row's own)."""
    out = torch.zeros(len(rows), k, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row[:k], dtype=torch.long)
    return out
