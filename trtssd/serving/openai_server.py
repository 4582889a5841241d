"""The OpenAI-compatible HTTP API over one `LLM`: FastAPI routes on its `AsyncLLM`.

    POST /v1/completions        prompt (text or token ids) -> text; SSE with "stream": true
    POST /v1/chat/completions   messages, through the tokenizer's chat template
    GET  /v1/models             the served model
    GET  /health                200 while the loop serves (a lost draft included: it decodes
                                in ar mode), 503 once it is dead
    GET  /metrics               Prometheus text format
    GET  /openapi.json          every route, request body field (allowed values) and error shape

Errors are OpenAI's {"error": {"message", "type", "param", "code"}} with the HTTP status in
``code``. With an API key, every /v1 route wants ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trtssd.llm import LLM
from trtssd.serving.async_llm import DEFAULT_MAX_WAITING, AsyncLLM, LoopStopped, Overloaded, RequestStream
from trtssd.serving.openai_requests import (ApiError, ChatCompletionRequest, CompletionRequest, ErrorResponse,
                                           GenerationRequest, ModelInfo, validation_error)
from trtssd.serving.openai_responses import DONE, Responder, sse
from trtssd.serving.prometheus_metrics import CONTENT_TYPE, ServerMetrics
from trtssd.structured.constraint import ConstraintError

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


class OpenAIServer:
    """One served model: its `AsyncLLM` (the loop thread), its metrics and the FastAPI app (``.app``).

    The caller owns ``llm`` (and closes it after `close`)."""

    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None,
                 max_waiting: int = DEFAULT_MAX_WAITING):
        self.llm = llm
        self.model = ModelInfo(model_name, llm.tokenizer, llm.max_model_len)
        self.api_key = api_key
        self.metrics = ServerMetrics(model_name, llm.spec.k)
        self.async_llm = AsyncLLM(llm, max_waiting, on_finished=self.metrics.observe)
        self.metrics.track(self.async_llm)
        self.created = int(time.time())
        self.app = self._build_app()

    def start(self) -> "OpenAIServer":
        """Start the loop thread, on the target's cores; the calling thread, which serves HTTP
        (or starts the thread that does), leaves them."""
        self.async_llm.start()
        return self

    def close(self) -> None:
        self.async_llm.shutdown()

    def _build_app(self) -> FastAPI:
        # strict_content_type=False: a body sent without a Content-Type is still read as JSON.
        app = FastAPI(title="trtssd", description="OpenAI-compatible server for speculative speculative decoding",
                      strict_content_type=False)
        # The key is checked before the body is (a dependency runs first), so a caller without it
        # learns nothing about the API but that it needs one. Documenting the errors ("4XX")
        # also keeps FastAPI from documenting its own 422, which this server never sends.
        v1 = {"dependencies": [Depends(self._authorize)],
              "responses": {"4XX": {"model": ErrorResponse}, "5XX": {"model": ErrorResponse}}}
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], **v1)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], **v1)
        app.add_api_route("/v1/models", self.models, methods=["GET"], **v1)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        # Starlette's own 404/405 and any unhandled error included: every error in one shape.
        for kind in (ApiError, RequestValidationError, StarletteHTTPException, Exception):
            app.add_exception_handler(kind, _error_response)
        return app

    # --- routes ----------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._generate(body, request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._generate(body, request)

    async def models(self) -> Response:
        card = {"id": self.model.name, "object": "model", "created": self.created, "owned_by": "trtssd",
                "root": self.model.name, "parent": None, "max_model_len": self.model.max_model_len, "permission": []}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self) -> Response:
        if not self.async_llm.alive:
            raise ApiError(503, f"the serving loop stopped: {self.async_llm.failure}")
        return JSONResponse({"status": "ok", "mode": self.llm.spec.mode.value, "draft": self.llm.draft_state})

    async def prometheus(self) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    # --- generation ------------------------------------------------------------------------------

    async def _generate(self, body: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        req = body.to_generation_request(self.model)
        await self._check_constraint(req)
        stream = self._submit(req)
        responder = Responder(req, self.model.name, self.model.tokenizer)
        if req.stream:
            return StreamingResponse(self._events(stream, responder), media_type="text/event-stream")
        return JSONResponse(responder.full(await self._collect(stream, request)))

    async def _check_constraint(self, req: GenerationRequest) -> None:
        """Compile the request's constraint on a worker thread, off the event loop and the target's
        cores; a constraint the grammar engine refuses is a 400 naming the field it came from. The
        compiled grammar is cached, so the loop's own check at submit finds it."""
        constraint = req.params.constraint
        if constraint is None:
            return
        grammars = self.async_llm.loop.scheduler.grammars
        if grammars is None:
            raise ApiError(400, "this model has no tokenizer: constraints cannot be served", req.constraint_param)
        try:
            await asyncio.to_thread(grammars.check, constraint)
        except ConstraintError as err:
            raise ApiError(400, f"invalid '{req.constraint_param}': {err}", req.constraint_param) from None

    def _submit(self, req: GenerationRequest) -> RequestStream:
        try:
            return self.async_llm.submit(req.prompt, req.params)
        except ValueError as err:  # the loop's own checks: prompt length, token id range
            raise ApiError(400, str(err), req.error_param(err)) from None
        except (Overloaded, LoopStopped) as err:
            raise ApiError(503, str(err)) from None

    async def _events(self, stream: RequestStream, responder: Responder):
        """The SSE body. A client that goes away cancels this generator: the request is aborted
        and its rows freed before the next round."""
        try:
            if responder.chat:
                for chunk in responder.role_chunks():
                    yield sse(chunk)
            started: set[int] = set()
            async for delta in stream:
                if delta.index not in started:  # a choice's echoed prompt and prompt logprobs come with its first delta
                    started.add(delta.index)
                    head = responder.prompt_chunk(delta.prompt_logprobs, delta.index)
                    if head is not None:
                        yield sse(head)
                # Every step's new tokens go out at once, as vLLM streams them, even when their text
                # is empty (a special token, or text held back): a client sees each token's time.
                if delta.text or delta.token_ids:
                    for chunk in responder.delta_chunks(delta):
                        yield sse(chunk)
            for output in stream.final.outputs:
                for chunk in responder.closing_chunks(output.finish_reason, output.index):
                    yield sse(chunk)
            if responder.req.include_usage:
                yield sse(responder.usage_chunk(stream.final))
        except LoopStopped as err:
            yield sse(ApiError(503, str(err)).body())
        finally:
            stream.abort()  # a no-op once finished
        yield DONE

    async def _collect(self, stream: RequestStream, request: Request):
        """The whole output of a non-streaming request; aborted if its client goes away."""
        task = asyncio.ensure_future(stream.result())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    log.info("client of %s went away: aborting it", stream.request_id)
                    stream.abort()
            return task.result()
        except LoopStopped as err:
            raise ApiError(503, str(err)) from None
        finally:
            if not task.done():  # this handler was cancelled (server shutting down)
                task.cancel()
                stream.abort()

    async def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'")


# A coroutine: Starlette would run a plain function in its thread pool.
async def _error_response(request: Request, err: Exception) -> JSONResponse:
    """Any error as an `ErrorResponse`."""
    if isinstance(err, RequestValidationError):
        err = validation_error(err.errors(), err.body, BODIES.get(request.url.path))
    elif isinstance(err, StarletteHTTPException):
        if isinstance(err.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body", from a body not UTF-8
            err = ApiError(400, f"the request body is not valid JSON: {err.__cause__}")
        else:
            err = ApiError(err.status_code, str(err.detail))
    elif not isinstance(err, ApiError):
        log.error("unhandled error: %s: %s", type(err).__name__, err)
        err = ApiError(500, f"internal error: {type(err).__name__}: {err}")
    return JSONResponse(err.body(), status_code=err.status)
