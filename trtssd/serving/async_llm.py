"""`AsyncLLM`: an `LLM` served from a thread of its own, the always-on target loop, requests joining and leaving between
rounds, each with an asyncio stream of deltas and a final record.

The loop thread owns the `TargetLoop` (nothing else touches it while serving) and deals in token
ids only. Requests, aborts, stops and the shutdown signal reach it through one thread-safe FIFO
queue, applied between steps, so a request joins the running batch at the next step (continuous
batching up to ``max_batch``) and an abort frees its rows before the next round. Each step's
outputs go to the event loop of their request's stream (``call_soon_threadsafe``), where the
output processor turns them into text: detokenization and stop strings never take the target's
cores. A failure of the loop itself stops serving: every pending request gets `LoopStopped` and
new ones are refused, so no client waits forever. A lost draft is not a failure: the loop decodes
in ar mode and serving goes on.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading

from trtssd.llm import LLM
from trtssd.cores import pin_thread
from trtssd.text.output_processor import Delta, OutputText, RequestOutput, request_output
from trtssd.runtime.sequence import Sequence, StepOutput
from trtssd.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING = 256  # requests queued beyond the running batch before new ones are refused


class LoopStopped(RuntimeError):
    """The loop thread failed or stopped: the request cannot be (or was not) completed."""


class Overloaded(RuntimeError):
    """The waiting queue is full: retry later."""


class RequestStream:
    """The client side of one request: ``async for delta in stream`` yields `Delta`s (of every
    sample, each with its ``index``, as the loop emits them); once the iteration ends,
    ``stream.final`` is the `RequestOutput`. Raises `LoopStopped` if the loop stops first.
    ``abort()`` ends the request, all its samples, early (its final record says "abort").

    Its output processing runs here, on the event loop that made it: the loop thread hands it
    each step's `StepOutput` and, at the end, each finished `Sequence` (one per sample)."""

    def __init__(self, samples: list[Sequence], server: "AsyncLLM", loop: asyncio.AbstractEventLoop):
        self.request_id = samples[0].request_id
        self.final: RequestOutput | None = None
        self._seq_ids = [s.seq_id for s in samples]
        self._server = server
        self._loop = loop
        self._texts = {s.seq_id: OutputText(server.tokenizer, s.params.stop, s.sample_index, s.params.min_tokens)
                       for s in samples}
        self._finished: dict[int, Sequence] = {}  # samples the loop has finished, by seq_id
        self._items: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta:
        if self.final is not None:
            raise StopAsyncIteration
        item = await self._items.get()
        if isinstance(item, RequestOutput):
            self.final = item
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def result(self) -> RequestOutput:
        """Wait for the whole output."""
        async for _ in self:
            pass
        return self.final

    @property
    def done(self) -> bool:
        return self.final is not None

    def abort(self) -> None:
        if self.final is None:
            for seq_id in self._seq_ids:
                self._server.abort(seq_id)

    # --- on the event loop: the output processor ------------------------------------------------

    def _on_output(self, out: StepOutput) -> None:
        delta = self._texts[out.seq_id].add(out)
        if delta is None:
            return  # past a stop string: the loop is being told
        if delta.stop_at is not None:  # a stop string ended the output: the loop ends the sequence there
            self._server.stop(out.seq_id)
        self._items.put_nowait(delta)

    def _on_finished(self, seq: Sequence) -> None:
        """One sample finished; the request's record once every sample has."""
        self._finished[seq.seq_id] = seq
        if len(self._finished) < len(self._seq_ids):
            return
        record = request_output([self._finished[i] for i in self._seq_ids], [self._texts[i] for i in self._seq_ids])
        if self._server.on_finished is not None:
            try:
                self._server.on_finished(record)
            except Exception:  # noqa: BLE001 - metrics must never take serving down
                log.exception("on_finished callback failed")
        self._items.put_nowait(record)


class AsyncLLM:
    """Serves an `LLM`'s target loop from a thread of its own.

    max_waiting: requests accepted beyond the ``max_batch`` running ones; past that, `submit`
        raises `Overloaded`.
    on_finished: called on the request's event loop with every `RequestOutput` (metrics); it
        must be quick and must not raise.
    The loop thread pins itself to the target's cores (``RuntimeConfig.target_cores``); `start`
    moves the calling thread, which serves the clients, off them.
    """

    def __init__(self, llm: LLM, max_waiting: int = DEFAULT_MAX_WAITING, on_finished=None):
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0; got {max_waiting!r}")
        self.llm = llm
        self.loop = llm.hand_over()
        self.tokenizer = llm.tokenizer
        self.max_waiting = max_waiting
        self.on_finished = on_finished
        self.failure: str | None = None  # why the loop stopped; None while it serves
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # (fn, args) for the loop thread; None: stop
        self._lock = threading.Lock()  # guards _streams and the dead/alive switch with submit
        self._streams: dict[int, RequestStream] = {}  # accepted and not finished: running + waiting
        self._thread = threading.Thread(target=self._run, name="trtssd-loop", daemon=True)
        self._started = False
        self._pinned = threading.Event()  # set once the loop thread is on its cores

    # --- the clients' side -----------------------------------------------------------------------

    def start(self) -> "AsyncLLM":
        if not self._started:
            self._started = True
            self._thread.start()
            self._pinned.wait()
            self.llm.leave_target_cores()
        return self

    @property
    def alive(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self.loop.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Accepted but not running yet (queued here or in the loop's waiting list)."""
        return max(0, len(self._streams) - len(self.loop.scheduler.running))

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request (its ``params.n`` samples together); call from a running asyncio event
        loop. Raises `FieldError` (a ValueError naming the field) for a request the loop cannot
        serve, `Overloaded` when the queue is full, `LoopStopped`. Each sample counts as a
        sequence in flight toward the limit."""
        samples = self.loop.new_sequences(prompt, params, request_id)
        stream = RequestStream(samples, self, asyncio.get_running_loop())
        with self._lock:
            if not self.alive:
                raise LoopStopped(self.failure or "the serving loop is not running")
            limit = self.loop.scheduler.max_batch + self.max_waiting
            if len(self._streams) + len(samples) > limit:
                raise Overloaded(f"server overloaded: {len(self._streams)} sequences in flight, the limit is {limit} "
                                 f"(max_batch {self.loop.scheduler.max_batch} running + max_waiting "
                                 f"{self.max_waiting} queued) and this request has {len(samples)}; retry later")
            for seq in samples:
                self._streams[seq.seq_id] = stream
            self._command(self._add, samples)  # one command: the loop admits a request's samples together
        return stream

    def _add(self, samples: list[Sequence]) -> None:
        for seq in samples:
            self.loop.add(seq)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop thread; requests still pending get `LoopStopped`."""
        if self._started and self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout_s)

    def abort(self, seq_id: int) -> None:
        """End a request between steps (its client went away); its stream gets the record."""
        self._command(self.loop.abort, seq_id)

    def stop(self, seq_id: int) -> None:
        """End a request between steps where a stop string ended its output (the stream's
        output processor cut it there)."""
        self._command(self.loop.stop, seq_id)

    def _command(self, fn, *args) -> None:
        """Have the loop thread call ``fn(*args)`` between steps (a sequence it returns has ended)."""
        self._commands.put((fn, args))

    # --- the loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        pin_thread("loop thread", self.llm.runtime.target_cores)
        self._pinned.set()
        try:
            while self._apply_commands(block=not self.loop.has_unfinished()):
                if self.loop.has_unfinished():
                    self._deliver(self.loop.step())
            self._die("the server was shut down")
        except BaseException as err:  # noqa: BLE001 - any failure here must reach every client
            log.exception("serving loop failed")
            self._die(f"serving loop failed: {type(err).__name__}: {err}")

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle). False once told to shut down."""
        try:
            command = self._commands.get(block=block)
            while command is not None:
                fn, args = command
                self._ended(fn(*args))
                command = self._commands.get_nowait()
        except queue.Empty:
            return True
        return False

    def _deliver(self, outputs: list[StepOutput]) -> None:
        calls = []
        for out in outputs:
            stream = self._streams[out.seq_id]
            calls.append((stream, stream._on_output, out))
            if out.finished:
                calls += self._finish_calls(self.loop.pop_finished(out.seq_id))
        _call_in_order(calls)

    def _ended(self, seq: Sequence | None) -> None:
        """Hand a sequence the loop has finished to its stream (None: it had ended already)."""
        _call_in_order(self._finish_calls(seq))

    def _finish_calls(self, seq: Sequence | None) -> list[tuple[RequestStream, object, Sequence]]:
        if seq is None:
            return []
        with self._lock:
            stream = self._streams.pop(seq.seq_id)
        return [(stream, stream._on_finished, seq)]

    def _die(self, reason: str) -> None:
        """Refuse new requests, then fail every request not finished."""
        with self._lock:
            self.failure = reason
            pending = list({id(stream): stream for stream in self._streams.values()}.values())  # one per request
            self._streams.clear()
        _call_in_order([(stream, stream._items.put_nowait, LoopStopped(reason)) for stream in pending])
        if pending:
            log.warning("%s: failed %d pending request(s)", reason, len(pending))


def _call_in_order(calls: list[tuple[RequestStream, object, object]]) -> None:
    """Run each ``(stream, fn, arg)`` as ``fn(arg)`` on its stream's event loop, in order, with one
    wake-up per event loop: a step's outputs for many requests wake their loop once, not once
    each (each wake-up is a pipe write and a hand-over of the GIL the target loop runs under)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, fn, arg in calls:
        by_loop.setdefault(stream._loop, []).append((fn, arg))
    for event_loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            event_loop.call_soon_threadsafe(_run_each, batch)


def _run_each(batch: list) -> None:
    for fn, arg in batch:
        try:
            fn(arg)
        except Exception:  # noqa: BLE001 - one stream's failure must not keep the others' outputs
            log.exception("delivering a step's output failed")
