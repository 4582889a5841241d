"""The Triton model: trtssd's `AsyncLLM` behind Triton's decoupled Python-backend API.

The model's process (Triton's Python stub) is the target rank: it builds an `LLM`, which starts
the draft rank as its own MPI job, and serves the LLM's target loop through an `AsyncLLM`
(its own thread; requests join the running batch between rounds). Triton calls ``execute`` with
new requests; each is parsed at once (its tensors are only valid during the call) and handed to
a coroutine on this model's asyncio thread, so ``execute`` returns immediately and requests
from any number of calls run together: continuous batching across Triton requests.

Each request gets exactly one FINAL response: its last output (with several samples,
``num_return_sequences``: the last sample's closing response), or an error (INVALID_ARG for a
bad request, UNAVAILABLE when the server is full or stopped, CANCELLED when the client cancelled or
went away). Cancellation is polled (``response_sender.is_cancelled()``) after every round of the
request and every `CANCEL_POLL_S` while it waits; a cancelled request is aborted in the loop,
which frees its rows on both ranks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trtssd.llm import LLM
from trtssd.text.output_processor import CompletionOutput, RequestOutput
from trtssd.serving.async_llm import AsyncLLM, LoopStopped, Overloaded, RequestStream
from trtssd.triton.metrics import TritonMetrics
from trtssd.triton.model_options import ModelOptions
from trtssd.triton.tensors import INPUTS
from trtssd.structured.constraint import ConstraintError
from trtssd.triton.triton_requests import GUIDE_INPUT, GenerateRequest, parse_request
from trtssd.triton.triton_responses import output_arrays

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05  # how often requests between rounds (waiting, or in a long round) are checked
FINALIZE_WAIT_S = 30.0  # how long unloading lets open requests send their last response


@dataclass
class _Open:
    """A request being served."""

    stream: RequestStream
    sender: object  # pb_utils.InferenceResponseSender
    cancelled: bool = False


class TritonModel:
    def __init__(self, args: dict, pb_utils, version_dir: Path):
        """``args``: Triton's initialize() arguments; ``version_dir``: the directory of model.py."""
        options = ModelOptions.read(version_dir)
        if not logging.getLogger().handlers:  # the stub has no logging set up: ours goes to its stderr
            logging.basicConfig(level=options.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.pb = pb_utils
        self.name = args["model_name"]
        _note_instance(args)
        self.llm = LLM(options.engine, **options.llm)
        try:
            self.metrics = TritonMetrics(pb_utils, self.name, self.llm.spec.k)
            self.events = asyncio.new_event_loop()
            # Started first: it moves this thread off the target's cores, and with it the
            # response thread started from here (where requests' text work runs).
            self.async_llm = AsyncLLM(self.llm, options.max_waiting, on_finished=self.metrics.observe).start()
            self._open: dict[str, _Open] = {}
            self._tasks: set[concurrent.futures.Future] = set()
            self._thread = threading.Thread(target=self.events.run_forever, name="trtssd-triton", daemon=True)
            self._thread.start()
            self._watcher = asyncio.run_coroutine_threadsafe(self._watch(), self.events)
        except BaseException:
            self.llm.close()
            raise
        log.info("model %s ready: %s mode, engine %s", self.name, self.llm.spec.mode.value, options.engine)

    # --- Triton's calls ------------------------------------------------------------------------

    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = parse_request(_inputs(self.pb, request), _parameters(request), self.llm.tokenizer)
            except ValueError as err:
                self._send_error(sender, str(err), self.pb.TritonError.INVALID_ARG)
                continue
            self._schedule(self._serve(job, sender))
        return None  # decoupled: every response goes through its sender

    def finalize(self) -> None:
        """Stop the loop (open requests get UNAVAILABLE), then the draft rank and shared memory."""
        try:
            self._watcher.cancel()
            self.async_llm.shutdown()
            concurrent.futures.wait(list(self._tasks), timeout=FINALIZE_WAIT_S)
            self.events.call_soon_threadsafe(self.events.stop)
            self._thread.join(FINALIZE_WAIT_S)
            self.events.close()
            self.metrics.close()
        finally:
            self.llm.close()
        log.info("model %s unloaded", self.name)

    # --- one request ---------------------------------------------------------------------------

    async def _serve(self, job: GenerateRequest, sender) -> None:
        try:
            await self._check_constraint(job)
            stream = self.async_llm.submit(job.prompt_ids, job.params)
        except ValueError as err:  # the loop's own checks: prompt + max_tokens within max_model_len, n within max_batch
            self._send_error(sender, _named(err), self.pb.TritonError.INVALID_ARG)
            return
        except (Overloaded, LoopStopped) as err:
            self._send_error(sender, str(err), self.pb.TritonError.UNAVAILABLE)
            return
        request = self._open[stream.request_id] = _Open(stream, sender)
        try:
            await self._respond(job, request)
        except LoopStopped as err:
            self._send_error(sender, str(err), self.pb.TritonError.UNAVAILABLE)
        finally:
            del self._open[stream.request_id]

    async def _check_constraint(self, job: GenerateRequest) -> None:
        """Compile the request's constraint on a worker thread (off this model's event loop and
        the target's cores); cached, so the loop's own check at submit finds it. ValueError
        naming the guide input when the grammar engine refuses it."""
        grammars = self.async_llm.loop.scheduler.grammars
        if job.params.constraint is None or grammars is None:
            return  # without a tokenizer the loop's check refuses it
        try:
            await asyncio.to_thread(grammars.check, job.params.constraint)
        except ConstraintError as err:
            raise ValueError(f"invalid '{GUIDE_INPUT}': {err}") from None

    async def _respond(self, job: GenerateRequest, request: _Open) -> None:
        generated: dict[int, int] = {}  # per sample: tokens so far
        cum_log_prob: dict[int, float] = {}
        async for delta in request.stream:
            index = delta.index
            generated[index] = generated.get(index, 0) + len(delta.token_ids)
            log_probs = _values(delta.logprobs) if job.return_log_probs else None
            # Token by token, as the final sum adds them.
            cum_log_prob[index] = sum(log_probs or (), cum_log_prob.get(index, 0.0))
            self._check_cancelled(request)
            if job.stream and not request.cancelled and (delta.text or delta.token_ids):
                self._send(request.sender, output_arrays(delta.text, delta.token_ids, len(job.prompt_ids),
                                                         generated[index], log_probs=log_probs,
                                                         cum_log_prob=cum_log_prob[index], sequence_index=index))
        final = request.stream.final
        if final.finish_reason == "abort":
            self._send_error(request.sender, "the request was cancelled", self.pb.TritonError.CANCELLED)
            return
        for output in final.outputs:  # each sample's closing (or only) response; the last one is FINAL
            flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output is final.outputs[-1] else 0
            self._send(request.sender, self._closing(job, final, output), flags)

    def _closing(self, job: GenerateRequest, final: RequestOutput, output: CompletionOutput) -> dict[str, np.ndarray]:
        """A sample's last response: streamed, its finish reason and the request's figures (its text
        went out round by round); else its whole output."""
        all_log_probs = _values(output.logprobs) if job.return_log_probs else None
        if job.stream:
            text, token_ids = "", ()
            log_probs = [] if job.return_log_probs else None
        else:
            text = (job.prompt_text if job.prepend_input else "") + output.text
            token_ids, log_probs = output.token_ids, all_log_probs
        return output_arrays(text, token_ids, final.prompt_tokens, len(output.token_ids), output.finish_reason,
                             final.speculation, log_probs, sum(all_log_probs or ()), output.index)

    def _check_cancelled(self, request: _Open) -> None:
        if request.cancelled or request.stream.done or not request.sender.is_cancelled():
            return
        request.cancelled = True
        log.info("request %s was cancelled: aborting it", request.stream.request_id)
        request.stream.abort()  # its final record (finish reason "abort") ends _respond

    async def _watch(self) -> None:
        """Between rounds: cancellation of every open request, and the loop's gauges."""
        while True:
            try:
                for request in list(self._open.values()):
                    self._check_cancelled(request)
                self.metrics.set_gauges(self.async_llm.num_running, self.async_llm.num_waiting,
                                        self.llm.draft_state == "lost")
            except Exception:  # noqa: BLE001 - the watch must outlive one bad poll
                log.exception("polling cancellations failed")
            await asyncio.sleep(CANCEL_POLL_S)

    # --- sending ---------------------------------------------------------------------------------

    def _send(self, sender, arrays: dict[str, np.ndarray], flags: int = 0) -> None:
        tensors = [self.pb.Tensor(name, array) for name, array in arrays.items()]
        self._deliver(sender, self.pb.InferenceResponse(output_tensors=tensors), flags)

    def _send_error(self, sender, message: str, code) -> None:
        response = self.pb.InferenceResponse(error=self.pb.TritonError(message=message, code=code))
        self._deliver(sender, response, self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _deliver(self, sender, response, flags: int) -> None:
        try:
            sender.send(response, flags=flags)
        except Exception as err:  # noqa: BLE001 - a client that is gone must not stop the others
            log.warning("could not send a response: %s: %s", type(err).__name__, err)

    # --- plumbing --------------------------------------------------------------------------------

    def _schedule(self, coroutine) -> None:
        task = asyncio.run_coroutine_threadsafe(coroutine, self.events)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: concurrent.futures.Future) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("request handling failed", exc_info=task.exception())



def _inputs(pb_utils, request) -> dict[str, np.ndarray]:
    """The request's input tensors, copied (Triton frees them when execute returns)."""
    out = {}
    for spec in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            out[spec.name] = np.array(tensor.as_numpy(), copy=True)
    return out


# The inputs that set the SamplingParams fields the loop's checks at submit name: n, and
# logit_bias's token ids, which only embedding_bias can put outside the vocabulary (a word's
# tokens lie inside it).
_INPUT_OF_FIELD = {"n": "num_return_sequences", "logit_bias": "embedding_bias"}


def _named(err: ValueError) -> str:
    """A submit error as the client reads it: naming the input it sent where its name differs."""
    name = _INPUT_OF_FIELD.get(getattr(err, "field", None))
    return f"'{name}': {err}" if name else str(err)


def _values(logprobs) -> list[float]:
    """The chosen tokens' log-probabilities of a delta or a final record."""
    return [entry.logprob for entry in logprobs or ()]


def _parameters(request) -> dict:
    raw = request.parameters()
    parameters = json.loads(raw) if raw else {}
    return parameters if isinstance(parameters, dict) else {}


def _note_instance(args: dict) -> None:
    kind, device = args.get("model_instance_kind", "CPU"), args.get("model_instance_device_id", "0")
    if kind == "GPU":
        log.warning("GPU instance (device %s): unverified, this model has not run on a GPU yet; the LLM places "
                    "its models itself", device)
