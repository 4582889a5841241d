"""OpenAI response bodies and Server-Sent Events, for /v1/completions and /v1/chat/completions.

Shapes as OpenAI (and vLLM) send them, so unchanged clients and benchmarks parse them: a
completion has ``choices[0].text``, a chat completion ``choices[0].message``; stream chunks carry
``choices[0].text`` or ``choices[0].delta``; with ``stream_options.include_usage`` every chunk has
``"usage": null`` and one more chunk with ``"choices": []`` carries the usage. Streams end with
``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from trtssd.serving.async_engine import FinishedRequest
from trtssd.serving.openai_requests import GenerationRequest, Kind

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ResponseHeader:
    """The fields every response and chunk of one request repeats."""

    id: str
    created: int
    model: str
    kind: Kind

    @classmethod
    def new(cls, kind: Kind, model: str) -> "ResponseHeader":
        prefix = "chatcmpl" if kind is Kind.CHAT else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, kind)

    def fields(self, chunk: bool) -> dict:
        if self.kind is Kind.CHAT:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def full_response(header: ResponseHeader, req: GenerationRequest, final: FinishedRequest) -> dict:
    """The non-streaming answer."""
    if header.kind is Kind.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": final.text}, "logprobs": None,
                  "finish_reason": final.finish_reason}
    else:
        choice = {"index": 0, "text": final.text, "logprobs": None, "finish_reason": final.finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(final.token_ids)
    out = {**header.fields(chunk=False), "choices": [choice], "usage": final.usage}
    if req.return_token_ids:
        out["prompt_token_ids"] = list(req.prompt)
    return out


def chunk(header: ResponseHeader, req: GenerationRequest, text: str, token_ids=None, finish_reason=None,
          role: bool = False) -> dict:
    """One streamed choice: new tokens' text (and ids when asked for), or the finish reason alone."""
    if header.kind is Kind.CHAT:
        closing = finish_reason is not None and not text
        delta = {"role": "assistant", "content": text} if role else ({} if closing else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids or ())
    out = {**header.fields(chunk=True), "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(header: ResponseHeader, final: FinishedRequest) -> dict:
    return {**header.fields(chunk=True), "choices": [], "usage": final.usage}
