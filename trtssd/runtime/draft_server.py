"""The draft rank's side of the protocol, free of any transport: one call per message.

The MPI loop of `trtssd.runtime.draft_rank` and the in-process `LocalDraft` both drive a
`DraftServer`, so the draft behaves the same behind either.
"""

from __future__ import annotations

import logging
import time

from trtssd.backends.loading import load_executor
from trtssd.models.tokenizer import load_tokenizer
from trtssd.config import Mode, ModelRef, RuntimeConfig, SpeculativeConfig, batch_tokens
from trtssd.runtime import protocol as P
from trtssd.runtime.draft_worker import DraftWorker
from trtssd.runtime.transport import RoundBuffers
from trtssd.structured.grammar import Grammars

log = logging.getLogger(__name__)

CALIBRATION_MAX_ROWS = 64  # the widest draft forward timed at start-up (costs beyond it are extrapolated)


def load_worker(draft_model: ModelRef, spec: SpeculativeConfig, runtime: RuntimeConfig, max_seq_len: int) -> DraftWorker:
    """The draft model and its worker, calibrated for the auto fan-out and for load control."""
    executor = load_executor(draft_model, max_seqs=runtime.max_batch, max_seq_len=max_seq_len,
                             max_batch_tokens=batch_tokens(spec, runtime), device=runtime.draft_device,
                             device_field="draft_device", row_invariant=False,
                             kept_prompts=runtime.prefix_cache_seqs)
    # The tokenizer is loaded at the first constrained request, not before.
    grammars = Grammars(lambda: load_tokenizer(draft_model.path), executor.vocab_size)
    worker = DraftWorker(executor, spec, runtime.prefix_cache_seqs, grammars)
    # The auto fan-out prices trees with it; load control bounds what speculation can give with it.
    if (spec.mode is Mode.SSD and spec.fixed_fanout is None) or spec.plain_under_load:
        # No wider than this configuration's widest tree or glue: the widest sizes cost the most
        # (seconds of start-up), and measurements beyond them would never be used.
        widest = runtime.max_batch * max(spec.budget, spec.k + 1)
        try:
            worker.calibrate(max_rows=min(CALIBRATION_MAX_ROWS, widest))  # what wider trees cost here
        except Exception:  # noqa: BLE001 - an optimisation: serve with the uncalibrated prior
            log.exception("draft forward calibration failed; the auto fan-out starts from a linear prior, load control "
                          "without a ceiling")
    return worker


class DraftServer:
    def __init__(self, worker: DraftWorker, buffers: RoundBuffers):
        self.worker = worker
        self.buffers = buffers
        self._prespec_s = 0.0  # pre-speculation time since the last reply, reported with the next
        self._branches = 0

    def handle(self, msg: object) -> P.SpeculateReply | None:
        """Apply one control message; a SpeculateRequest gets a reply (its rows in the buffer)."""
        if isinstance(msg, P.Prefill):
            self.worker.prefill(msg)
        elif isinstance(msg, P.Release):
            self.worker.release(msg.seq_ids)
        elif isinstance(msg, P.SpeculateRequest):
            return self._speculate(msg)
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")
        return None

    def _speculate(self, req: P.SpeculateRequest) -> P.SpeculateReply:
        t0 = time.perf_counter()
        ans = self.worker.answer(req)
        rows = len(req.outcomes)
        self.buffers.tokens(req.buffer)[:rows].copy_(ans.tokens)
        if ans.probs is not None:
            self.buffers.probs(req.buffer)[:rows].copy_(ans.probs)
        self.buffers.publish(req.buffer)  # before the reply: the target reads once it has the reply
        reply = P.SpeculateReply(
            round_id=req.round_id,
            buffer=req.buffer,
            sources=tuple(ans.sources),
            point_mass=tuple(ans.point_mass),
            has_probs=ans.probs is not None,
            answer_time_s=time.perf_counter() - t0,
            prespec_time_s=self._prespec_s,
            tree_branches=self._branches,
            cached_tokens=tuple(ans.cached_tokens),
        )
        self._prespec_s, self._branches = 0.0, 0
        return reply

    def after_reply(self) -> None:
        """SSD: pre-speculate for the next round while the target verifies this one."""
        if self.worker.spec.mode is Mode.SSD:
            t0 = time.perf_counter()
            self._branches = self.worker.prespeculate()
            self._prespec_s = time.perf_counter() - t0

    def when_idle(self) -> None:
        """SSD, with no message waiting: pre-speculate the first round of sequences just
        prefilled, while the target still prefills them."""
        if self.worker.spec.mode is Mode.SSD:
            t0 = time.perf_counter()
            if self.worker.prespeculate_first_tokens():
                self._prespec_s += time.perf_counter() - t0
