"""The always-on engine: the target loop in its own thread, requests joining and leaving between
rounds, each with an asyncio stream of deltas and a final record.

The loop thread owns the `TargetLoop` (nothing else touches it while serving). Requests, aborts
and the stop signal reach it through one thread-safe FIFO queue, applied between steps, so a
request joins the running batch at the next step (continuous batching up to ``max_batch``) and an
abort frees its rows before the next round. Results go back to each request's asyncio queue with
``call_soon_threadsafe``. A failure of the loop itself kills the engine: every pending request
gets `EngineDead` and new ones are refused, so no client waits forever. A lost draft is not a
failure: the loop decodes in ar mode and serving goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from trtssd.runtime.affinity import pin_thread
from trtssd.runtime.metrics import SpecMetrics
from trtssd.runtime.target_loop import Sequence as TargetSequence, StepOutput, TargetLoop
from trtssd.sampling import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING = 256  # requests queued beyond the running batch before new ones are refused


class EngineDead(RuntimeError):
    """The loop thread failed or stopped: the request cannot be (or was not) completed."""


class Overloaded(RuntimeError):
    """The waiting queue is full: retry later."""


@dataclass(frozen=True)
class Delta:
    """What one round added to one request."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked for them


@dataclass(frozen=True)
class FinishedRequest:
    """The final record of one request."""

    request_id: str
    prompt_tokens: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop", "length" or "abort"
    ttft_s: float | None  # submit -> first token (None when aborted before it)
    e2e_s: float  # submit -> finished
    token_gaps_s: tuple[float, ...]  # between successive deltas of this request (inter-token latency)
    spec: SpecMetrics  # this request's speculation counters
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked for them

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class RequestStream:
    """The client side of one request: ``async for delta in stream`` yields `Delta`s; once the
    iteration ends, ``stream.final`` is the `FinishedRequest`. Raises `EngineDead` if the engine
    fails first. ``abort()`` ends the request early (its final record says "abort")."""

    def __init__(self, request_id: str, engine: "AsyncEngine", loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.final: FinishedRequest | None = None
        self._engine = engine
        self._loop = loop
        self._items: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta:
        if self.final is not None:
            raise StopAsyncIteration
        item = await self._items.get()
        if isinstance(item, FinishedRequest):
            self.final = item
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def result(self) -> FinishedRequest:
        """Wait for the whole output."""
        async for _ in self:
            pass
        return self.final

    @property
    def done(self) -> bool:
        return self.final is not None

    def abort(self) -> None:
        if self.final is None:
            self._engine.abort(self.request_id)

    def _put(self, item) -> None:
        """From the loop thread: hand an item to the asyncio side."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class _Request:
    """The loop thread's record of a request in flight."""

    stream: RequestStream
    prompt: list[int]
    params: SamplingParams
    arrival: float
    seq_id: int | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    first_token_time: float | None = None
    last_delta_time: float | None = None
    gaps: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _Add:
    request: _Request


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    pass


class AsyncEngine:
    """Serves a `TargetLoop` from a thread of its own.

    max_waiting: requests accepted beyond the ``max_batch`` running ones; past that, `submit`
        raises `Overloaded`.
    on_finished: called in the loop thread with every `FinishedRequest` (metrics); it must be
        quick and must not raise.
    cores: the CPU cores the loop thread pins itself to (the target's, ``RuntimeConfig.target_cores``);
        None leaves it where it starts.
    """

    def __init__(self, loop: TargetLoop, max_waiting: int = DEFAULT_MAX_WAITING, on_finished=None,
                 cores: Sequence[int] | None = None):
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0; got {max_waiting!r}")
        self.loop = loop
        self.max_waiting = max_waiting
        self.on_finished = on_finished
        self.cores = tuple(cores) if cores else None
        self.failure: str | None = None  # why the engine died; None while it serves
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _in_flight and the dead/alive switch with submit
        self._in_flight = 0  # accepted and not finished: running + waiting
        self._by_id: dict[str, _Request] = {}  # loop thread only
        self._by_seq: dict[int, _Request] = {}  # loop thread only
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="trtssd-engine", daemon=True)
        self._started = False
        self._pinned = threading.Event()  # set once the loop thread is on its cores

    # --- the asyncio side ----------------------------------------------------------------------

    def start(self) -> "AsyncEngine":
        if not self._started:
            self._started = True
            self._thread.start()
            self._pinned.wait()
        return self

    @property
    def alive(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self.loop.running)

    @property
    def num_waiting(self) -> int:
        """Accepted but not running yet (queued here or in the loop's waiting list)."""
        return max(0, self._in_flight - len(self.loop.running))

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request; call from a running asyncio event loop. Raises ValueError for a
        request the loop cannot serve, `Overloaded` when the queue is full, `EngineDead`."""
        self.loop.check_request(prompt, params)  # reads only fixed sizes: safe beside the thread
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        request = _Request(stream, list(prompt), params, time.perf_counter())
        with self._lock:
            if not self.alive:
                raise EngineDead(self.failure or "the engine is not running")
            limit = self.loop.max_batch + self.max_waiting
            if self._in_flight >= limit:
                raise Overloaded(f"server overloaded: {self._in_flight} requests in flight, the limit is {limit} "
                                 f"(max_batch {self.loop.max_batch} running + max_waiting {self.max_waiting} "
                                 "queued); retry later")
            self._in_flight += 1
            self._commands.put(_Add(request))
        return stream

    def abort(self, request_id: str) -> None:
        """End a request at the next step boundary (thread-safe; unknown ids are ignored)."""
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop thread; requests still pending get `EngineDead`."""
        if self._started and self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout_s)

    # --- the loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        pin_thread("engine thread", self.cores)
        self._pinned.set()
        try:
            while self._apply_commands(block=not self.loop.has_unfinished()):
                if self.loop.has_unfinished():
                    self._deliver(self.loop.step(), time.perf_counter())
            self._die("the engine was shut down")
        except BaseException as err:  # noqa: BLE001 - any failure here must reach every client
            log.exception("engine loop failed")
            self._die(f"engine loop failed: {type(err).__name__}: {err}")

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle). False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command.request)
            else:
                self._abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request: _Request) -> None:
        request.seq_id = self.loop.add_request(request.prompt, request.params)
        self._by_id[request.stream.request_id] = request
        self._by_seq[request.seq_id] = request

    def _abort(self, request_id: str) -> None:
        request = self._by_id.get(request_id)
        if request is None:
            return  # finished meanwhile, or never accepted
        seq = self.loop.abort(request.seq_id)
        if seq is not None:
            self._finish(request, "abort", seq, time.perf_counter())

    def _deliver(self, outputs: list[StepOutput], now: float) -> None:
        for out in outputs:
            request = self._by_seq[out.seq_id]
            if out.new_token_ids:
                if request.first_token_time is None:
                    request.first_token_time = now
                else:
                    request.gaps.append(now - request.last_delta_time)
                request.last_delta_time = now
            request.token_ids += out.new_token_ids
            request.text.append(out.text_delta)
            request.stream._put(Delta(tuple(out.new_token_ids), out.text_delta, out.logprobs))
            if out.finished:
                seq = self.loop.pop_finished(out.seq_id)
                self._finish(request, out.finish_reason, seq, now)

    def _finish(self, request: _Request, reason: str, seq: TargetSequence, now: float) -> None:
        del self._by_id[request.stream.request_id]
        del self._by_seq[request.seq_id]
        record = FinishedRequest(
            request_id=request.stream.request_id,
            prompt_tokens=len(request.prompt),
            token_ids=tuple(request.token_ids),
            text="".join(request.text),
            finish_reason=reason,
            ttft_s=None if request.first_token_time is None else request.first_token_time - request.arrival,
            e2e_s=now - request.arrival,
            token_gaps_s=tuple(request.gaps),
            spec=seq.metrics,
            logprobs=tuple(seq.logprobs),
        )
        with self._lock:
            self._in_flight -= 1
        if self.on_finished is not None:
            try:
                self.on_finished(record)
            except Exception:  # noqa: BLE001 - metrics must never take serving down
                log.exception("on_finished callback failed")
        request.stream._put(record)

    def _die(self, reason: str) -> None:
        """Refuse new requests, then fail every request not finished."""
        with self._lock:
            self.failure = reason
        pending = list(self._by_id.values())
        while True:  # requests queued before the switch, never applied
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                pending.append(command.request)
        for request in pending:
            request.stream._put(EngineDead(reason))
        self._by_id.clear()
        self._by_seq.clear()
        with self._lock:
            self._in_flight = 0
        if pending:
            log.warning("%s: failed %d pending request(s)", reason, len(pending))
