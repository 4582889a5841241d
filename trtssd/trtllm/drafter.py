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

The draft rank is either one the caller already has (any ``DraftClient``) or one the drafter
starts for itself from an engine's draft, the way ``LLM`` does (``trtssd.runtime.launch``: its own
MPI job by default); :meth:`SSDDraftSource.close` then ends that job with nothing left behind.

:class:`SSDDraftSource` and :func:`open_draft_source` are the logic, plain Python tested without
TensorRT-LLM; :func:`make_drafter` joins them with TensorRT-LLM's ``Drafter`` base class and is
unverified: never run.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass
from typing import Sequence

from trtssd.engines import resolve_models
from trtssd.config import Mode, ModelRef, RuntimeConfig, SpeculativeConfig, renamed_options
from trtssd.runtime import protocol as P
from trtssd.runtime.draft_client import DraftClient
from trtssd.runtime.launch import start_draft
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
                 max_concurrency: int | None = None, owns_client: bool = False):
        if not isinstance(max_draft_len, int) or max_draft_len < 1:
            raise ValueError(f"max_draft_len must be an int >= 1, got {max_draft_len!r}")
        self.client = client
        self.owns_client = owns_client  # started for this drafter: close() ends it
        self.max_draft_len = max_draft_len  # read by TensorRT-LLM's Drafter (CUDA-graph padding)
        self.max_concurrency = max_concurrency  # what TensorRT-LLM's Drafter.__init__ sets
        self.params = params
        self._drafted: dict[int, Drafted] = {}
        self._round = 0
        self._last_call: float | None = None

    def close(self) -> None:
        """End the draft rank this drafter started (idempotent); a caller's own client is left
        running (its owner closes it)."""
        if self.owns_client:
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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


def _configs(options: dict) -> tuple[SpeculativeConfig, RuntimeConfig]:
    """SpeculativeConfig and RuntimeConfig from keyword options, as ``LLM`` takes them."""
    options = renamed_options(options)
    spec_opts = {k: v for k, v in options.items() if k in SpeculativeConfig.__dataclass_fields__}
    run_opts = {k: v for k, v in options.items() if k in RuntimeConfig.__dataclass_fields__}
    unknown = sorted(set(options) - set(spec_opts) - set(run_opts))
    if unknown:
        allowed = sorted(set(SpeculativeConfig.__dataclass_fields__) | set(RuntimeConfig.__dataclass_fields__))
        raise TypeError(f"unknown drafter option(s) {unknown}; allowed: {allowed}")
    spec = SpeculativeConfig(**spec_opts)
    if spec.mode is Mode.AR:
        raise ValueError("mode must be 'sd' or 'ssd' for a drafter (it asks a draft rank for chains); got 'ar'")
    return spec, RuntimeConfig(**run_opts)


def _draft_len(max_draft_len: int | None, spec: SpeculativeConfig) -> int:
    """The drafter's max_draft_len: the draft rank's k unless a shorter one is asked for."""
    if max_draft_len is None:
        return spec.k
    if not isinstance(max_draft_len, int) or not 1 <= max_draft_len <= spec.k:
        raise ValueError(f"max_draft_len must be an int in [1, k={spec.k}] (the draft rank proposes k tokens); "
                         f"got {max_draft_len!r}")
    return max_draft_len


def start_draft_client(engine: str | None = None, *, vocab_size: int, draft: ModelRef | None = None,
                       launch: str = "spawn", **options) -> tuple[DraftClient, SpeculativeConfig]:
    """A draft rank of its own for ``engine``'s draft (or the ``draft`` model; neither: the default
    engine), started as ``LLM`` starts one. ``vocab_size``: the TensorRT-LLM target's vocabulary
    (the round buffers hold rows that wide; the draft rank checks its model against it).
    ``options``: SpeculativeConfig and RuntimeConfig fields, as ``LLM`` takes them."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int (the target's vocabulary), got {vocab_size!r}")
    spec, runtime = _configs(options)
    if draft is None:
        draft = resolve_models(engine, None, None)[1]
    elif engine is not None:
        raise ValueError("give either engine or draft, not both")
    return start_draft(launch, draft, spec, runtime, vocab_size), spec


def open_draft_source(engine: str | None = None, *, vocab_size: int, max_draft_len: int | None = None,
                      params: SamplingParams = GREEDY, max_concurrency: int | None = None,
                      cls: type[SSDDraftSource] = SSDDraftSource, **options) -> SSDDraftSource:
    """An ``SSDDraftSource`` on a draft rank it starts (:func:`start_draft_client`); its
    ``close()`` ends that rank. ``max_draft_len`` defaults to the draft rank's ``k``."""
    client, spec = start_draft_client(engine, vocab_size=vocab_size, **options)
    try:
        return cls(client, _draft_len(max_draft_len, spec), params, max_concurrency, owns_client=True)
    except BaseException:
        client.close()  # a bad argument must not leave a draft job behind
        raise


def make_drafter(client: DraftClient | None = None, max_draft_len: int | None = None, params: SamplingParams = GREEDY,
                 max_concurrency: int | None = None, **start):
    """An ``SSDDraftSource`` that is also TensorRT-LLM's ``Drafter``, for
    ``UserProvidedDecodingConfig(max_draft_len=drafter.max_draft_len, drafter=drafter)``.

    With ``client``: that running draft rank. Without: one started for this drafter from
    ``start`` (``engine`` or ``draft``, ``vocab_size``, ``launch`` and LLM's speculative/runtime
    options, see :func:`start_draft_client`); call ``drafter.close()`` to end it.

    unverified: never run (TensorRT-LLM's PyTorch backend, main branch, cannot be installed here).
    """
    if client is not None and start:
        raise TypeError(f"give a running client or options to start one, not both; got client and {sorted(start)}")
    # Before any draft rank starts: without TensorRT-LLM nothing is spawned, nothing left behind.
    base = import_tensorrt_llm("tensorrt_llm._torch.speculative.drafter", "The SSD drafter").Drafter
    cls = types.new_class("SSDDrafter", (SSDDraftSource, base))  # our prepare_draft_tokens first
    if client is not None:
        if max_draft_len is None:
            raise TypeError("max_draft_len is required with a client (the client's k is not known here)")
        drafter = cls(client, max_draft_len, params, max_concurrency)
    else:
        drafter = open_draft_source(max_draft_len=max_draft_len, params=params, max_concurrency=max_concurrency,
                                    cls=cls, **start)
    try:
        base.__init__(drafter, max_concurrency)  # whatever else TensorRT-LLM's base sets up
    except BaseException:
        drafter.close()  # ends the draft rank only if this drafter started it
        raise
    return drafter
