"""Who scores a round's rows on the target: a `Verifier`.

The default, `ExecutorVerifier`, is the target loop's own executor: one k+1-token forward per
row, `spec_decode.verify`, and the commit of what was accepted. Another target engine
(TensorRT-LLM, trtssd/trtllm/) plugs in behind the same calls; prefill stays on the loop's
executor either way. Because the default verifier's target *is* that executor, its rounds can
carry prompt pieces in the same forward (``prompts``): new prompts are prefilled beside the
running rows' round, as llama-server batches them, and the executor keeps every row exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn.functional import pad

from trtssd.backends.base import Chunk, Executor, chain_chunk
from trtssd.runtime.sequence import Sequence
from trtssd.sampling import SamplingParams, TokenLogprob, greedy_tokens, processed_probs, sample, token_logprobs
from trtssd.spec_decode.verify import verify
from trtssd.structured.grammar import apply_bitmask, chain_bitmask


@dataclass(frozen=True)
class Verified:
    """Each row's verification result, in the order of the rows given."""

    num_accepted: tuple[int, ...]  # drafts accepted per row
    bonus: tuple[int, ...]  # the target's token after them per row
    # Per row, the logprobs of its accepted drafts and bonus where its SamplingParams.logprobs
    # asks for them, else None; empty when no row asks.
    logprobs: tuple[list[TokenLogprob] | None, ...] = ()
    # The logits of the prompt chunks the round's forward carried (ExecutorVerifier's ``prompts``).
    prompt_logits: tuple[torch.Tensor, ...] = ()


class Verifier(Protocol):
    """Scores the running rows on the target and returns what each one emits.

    Rows are `Sequence`s whose ``bonus`` is the pending token (not yet in the target's state);
    the verifier brings its target's state up to date with what it returns. ``prompts``: prompt
    chunks the round's forward carries, where ``carries_prompts`` (the verifier's target is the
    loop's executor); their logits come back in `Verified.prompt_logits`.
    """

    carries_prompts: bool

    def verify(self, seqs: list[Sequence], proposals: torch.Tensor, probs: torch.Tensor | None,
               point_mass: tuple[bool, ...], num_proposals: tuple[int, ...] | None = None,
               prompts: tuple[Chunk, ...] = ()) -> Verified:
        """One speculative round: ``proposals`` [B, K] from the draft, ``probs`` its q' rows
        [B, K, V] (None for greedy rows), ``point_mass`` per row, ``num_proposals`` the
        proposals of each row to verify (its first ones; None: all K)."""

    def plain(self, seqs: list[Sequence], prompts: tuple[Chunk, ...] = ()) -> Verified:
        """One plain step: a round without drafts (nothing accepted, each row's next token as
        its bonus)."""

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError for sampling parameters this target cannot honour exactly."""


class ExecutorVerifier:
    """The default verifier: the loop's own executor, one k+1-token pass, exact verification.
    ``prompts``: prompt chunks run in the same forward, their logits returned as they come
    (committing them is the scheduler's)."""

    carries_prompts = True

    def __init__(self, target: Executor):
        self.target = target

    def check(self, params: SamplingParams) -> None:
        pass  # trtssd.sampling implements every SamplingParams field

    def verify(self, seqs: list[Sequence], proposals: torch.Tensor, probs: torch.Tensor | None,
               point_mass: tuple[bool, ...], num_proposals: tuple[int, ...] | None = None,
               prompts: tuple[Chunk, ...] = ()) -> Verified:
        # Each row [bonus, s_1..s_n] appended causally at its committed length.
        k = proposals.shape[1]
        counts = num_proposals if num_proposals is not None else (k,) * len(seqs)
        rows = [row[:n] for row, n in zip(proposals.tolist(), counts)]
        chunks = [chain_chunk(s.seq_id, [s.bonus] + rows[i], self.target.committed(s.seq_id))
                  for i, s in enumerate(seqs)]
        # [B, k+1, V]; a row with fewer proposals gets zero rows (verify never reads past its count).
        out, prompt_logits = self._forward(chunks, prompts)
        padded = [pad(o, (0, 0, 0, k + 1 - len(o))) for o in out]
        logits = constrained(torch.stack(padded), seqs, rows)
        result = verify(
            logits, proposals.clone(), torch.tensor(counts, dtype=torch.long), probs,
            torch.tensor(point_mass, dtype=torch.bool), [s.params for s in seqs],
            [s.generator for s in seqs], [s.history() for s in seqs],
        )
        accepted, bonus = tuple(result.num_accepted.tolist()), tuple(result.bonus.tolist())
        for seq, n in zip(seqs, accepted):
            self.target.commit(seq.seq_id, n + 1)
        return Verified(accepted, bonus, emitted_logprobs(seqs, logits, [rows[i][:n] + [b] for i, (n, b)
                                                                   in enumerate(zip(accepted, bonus))]), prompt_logits)

    def plain(self, seqs: list[Sequence], prompts: tuple[Chunk, ...] = ()) -> Verified:
        chunks = [chain_chunk(s.seq_id, [s.bonus], self.target.committed(s.seq_id)) for s in seqs]
        out, prompt_logits = self._forward(chunks, prompts)
        logits = constrained(torch.stack(out), seqs, [[] for _ in seqs])[:, 0]
        params, history = [s.params for s in seqs], [s.history() for s in seqs]
        if all(p.is_greedy for p in params):
            nxt = greedy_tokens(logits, params, history)  # what sampling the one-hot p would return
        else:
            nxt = sample(processed_probs(logits, params, history), [s.generator for s in seqs])
        for seq in seqs:
            self.target.commit(seq.seq_id, 1)
        tokens = tuple(nxt.tolist())
        return Verified((0,) * len(seqs), tokens, emitted_logprobs(seqs, logits[:, None], [[t] for t in tokens]),
                        prompt_logits)

    def _forward(self, chunks: list[Chunk], prompts: tuple[Chunk, ...]) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        """One forward of the rows' chunks and the prompt chunks: (the rows' logits, the prompts')."""
        out = self.target.forward([*prompts, *chunks])
        return out[len(prompts):], tuple(out[:len(prompts)])


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


def emitted_logprobs(seqs: list[Sequence], logits: torch.Tensor, emitted: list[list[int]]) -> tuple[list[TokenLogprob] | None, ...]:
    """Each row's emitted tokens' logprobs where its request asks for them (logits [B, n, V]
    score row b's emitted tokens at positions 0..), or () when no row does."""
    if all(s.params.logprobs is None for s in seqs):
        return ()
    return tuple(None if s.params.logprobs is None else
                 token_logprobs(logits[i, :len(emitted[i])], emitted[i], s.params, history=s.history())
                 for i, s in enumerate(seqs))
