"""SSD inside ``tensorrt_llm.LLM`` (PyTorch backend): a drafter that asks a trtssd draft rank.

TensorRT-LLM's hook for user drafters is ``UserProvidedDecodingConfig(max_draft_len=K,
drafter=...)`` (``tensorrt_llm/llmapi/llm_args.py``; linear chains only: it sets
``max_total_draft_tokens = max_draft_len``). Before each target step its executor calls
``drafter.prepare_draft_tokens(scheduled_requests, resource_manager)``
(``tensorrt_llm/_torch/speculative/drafter.py``), and the drafter writes each generation
request's ``py_draft_tokens``; TensorRT-LLM's sampler then verifies them (as it does the NGram
drafter's, ``_torch/speculative/ngram.py``, whose request fields this follows: ``request_id``,
``get_tokens(0)``, ``py_orig_prompt_len``, ``py_max_new_tokens``, ``py_draft_tokens``).

Here ``prepare_draft_tokens`` works out, from each request's tokens, the outcome of its last
verification (accepted drafts, bonus, and tokens decoded without drafts), and asks a running
trtssd draft rank (any ``DraftClient``: ``DraftLink`` over MPI, or ``LocalDraft``) for the
speculation that follows it, which the draft rank has usually pre-computed (a cache hit) or
answers with a backup. No draft probabilities are handed to TensorRT-LLM, so its sampler verifies
the tokens as plain drafts; the draft rank is asked for greedy chains by default.

:class:`SSDDraftSource` is the logic, plain Python tested without TensorRT-LLM; :func:`make_drafter`
joins it with TensorRT-LLM's ``Drafter`` base class and is unverified: never run.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass
from typing import Sequence

from trtssd.runtime import protocol as P
from trtssd.runtime.draft_client import DraftClient
from trtssd.runtime.transport import PeerLost
from trtssd.sampling import SamplingParams
from trtssd.trtllm.availability import import_tensorrt_llm

log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)  # what the draft rank speculates with by default


@dataclass(frozen=True)
class Drafted:
    """What was proposed to one request: its token count then, and the drafts."""

    num_tokens: int
    drafts: tuple[int, ...]


def first_outcome(seq_id: int, tokens: Sequence[int], prompt_len: int,
                  params: SamplingParams = GREEDY) -> tuple[P.Prefill, P.Outcome]:
    """A request the draft rank has not seen: its prompt, then everything generated since as the
    first outcome (the first token as the bonus, any later ones as plain tokens)."""
    if not 0 < prompt_len < len(tokens):
        raise ValueError(f"request {seq_id}: need 0 < prompt_len ({prompt_len}) < tokens ({len(tokens)})")
    prefill = P.Prefill(seq_id, tuple(tokens[:prompt_len]), params)
    return prefill, P.Outcome(seq_id, 0, tokens[prompt_len], tuple(tokens[prompt_len + 1:]))


def outcome_since(seq_id: int, tokens: Sequence[int], drafted: Drafted) -> P.Outcome | None:
    """The outcome of the last verification: the drafts accepted, the bonus after them, and any
    tokens decoded since without drafts. None when the request has not moved (not scheduled)."""
    new = list(tokens[drafted.num_tokens:])
    if not new:
        return None
    accepted = 0  # a rejected draft is never the bonus, so the matching prefix is what was accepted
    while accepted < min(len(new) - 1, len(drafted.drafts)) and new[accepted] == drafted.drafts[accepted]:
        accepted += 1
    return P.Outcome(seq_id, accepted, new[accepted], tuple(new[accepted + 1:]))


class SSDDraftSource:
    """``prepare_draft_tokens`` backed by a trtssd draft rank (see the module docstring).

    A request absent from a step's generation requests is released on the draft rank; should it
    come back (it was only paused), it is sent again as a new sequence: always correct, at most
    some wasted prefill.
    """

    def __init__(self, client: DraftClient, max_draft_len: int, params: SamplingParams = GREEDY,
                 max_concurrency: int | None = None):
        if not isinstance(max_draft_len, int) or max_draft_len < 1:
            raise ValueError(f"max_draft_len must be an int >= 1, got {max_draft_len!r}")
        self.client = client
        self.max_draft_len = max_draft_len  # read by TensorRT-LLM's Drafter (CUDA-graph padding)
        self.max_concurrency = max_concurrency  # what TensorRT-LLM's Drafter.__init__ sets
        self.params = params
        self._drafted: dict[int, Drafted] = {}
        self._round = 0
        self._last_call: float | None = None

    def prepare_draft_tokens(self, scheduled_requests, resource_manager=None) -> None:
        requests = list(scheduled_requests.generation_requests)
        released = tuple(sorted(set(self._drafted) - {r.request_id for r in requests}))
        for seq_id in released:
            del self._drafted[seq_id]
        rows, outcomes = [], []
        for request in requests:
            tokens = list(request.get_tokens(0))
            drafted = self._drafted.get(request.request_id)
            if drafted is None:  # new to the draft rank (a lost draft shows in client.alive)
                prefill, outcome = first_outcome(request.request_id, tokens, request.py_orig_prompt_len, self.params)
                self.client.send(prefill)
            else:
                outcome = outcome_since(request.request_id, tokens, drafted)
                if outcome is None:  # not moved since its drafts: they still stand
                    request.py_draft_tokens = list(drafted.drafts)
                    continue
            rows.append((request, len(tokens)))
            outcomes.append(outcome)
        for (request, num_tokens), chain in zip(rows, self._speculate(outcomes, released)):
            # No drafts past the request's last token (as TensorRT-LLM's NGram drafter does).
            room = request.py_orig_prompt_len + request.py_max_new_tokens - 1 - num_tokens
            chain = chain[: max(room, 0)]
            request.py_draft_tokens = list(chain)
            self._drafted[request.request_id] = Drafted(num_tokens, chain)

    def _speculate(self, outcomes: list[P.Outcome], released: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The draft rank's chains for ``outcomes``; no drafts at all once the draft is lost
        (TensorRT-LLM then decodes plainly)."""
        if not self.client.alive:
            return [() for _ in outcomes]
        if not outcomes:
            if released:  # nothing to draft this step, but the draft rank can free rows now
                self.client.send(P.Release(released))
            return []
        now = time.perf_counter()
        # Time since the last call: the target step that verified the previous drafts (the
        # draft rank's backup policy weighs its own cost against it).
        step_s = now - self._last_call if self._last_call is not None else 0.0
        self._last_call = now
        request = P.SpeculateRequest(self._round, tuple(outcomes), self._round % 2, step_s, released)
        self._round += 1
        try:
            reply, tokens, _ = self.client.speculate(request)
        except PeerLost as err:
            log.warning("trtssd draft rank lost (%s): TensorRT-LLM continues without drafts", err)
            return [() for _ in outcomes]
        if reply.round_id != request.round_id:
            self.client.mark_dead(f"reply to round {reply.round_id} while waiting for round {request.round_id}")
            return [() for _ in outcomes]
        return [tuple(int(t) for t in row[: self.max_draft_len]) for row in tokens.tolist()]


def make_drafter(client: DraftClient, max_draft_len: int, params: SamplingParams = GREEDY,
                 max_concurrency: int | None = None):
    """An ``SSDDraftSource`` that is also TensorRT-LLM's ``Drafter``, for
    ``UserProvidedDecodingConfig(max_draft_len=max_draft_len, drafter=make_drafter(...))``.

    unverified: never run (TensorRT-LLM's PyTorch backend, main branch, cannot be installed here).
    """
    base = import_tensorrt_llm("tensorrt_llm._torch.speculative.drafter", "The SSD drafter").Drafter
    cls = types.new_class("SSDDrafter", (SSDDraftSource, base))  # our prepare_draft_tokens first
    drafter = cls(client, max_draft_len, params, max_concurrency)
    base.__init__(drafter, max_concurrency)  # whatever else TensorRT-LLM's base sets up
    return drafter
