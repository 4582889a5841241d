"""OpenAI response bodies and Server-Sent Events, for /v1/completions and /v1/chat/completions.

Shapes as OpenAI (and vLLM) send them, so unchanged clients and benchmarks parse them: a
completion has ``choices[0].text``, a chat completion ``choices[0].message``; stream chunks carry
``choices[0].text`` or ``choices[0].delta``; with ``stream_options.include_usage`` every chunk has
``"usage": null`` and one more chunk with ``"choices": []`` carries the usage. Streams end with
``data: [DONE]``.

Logprobs, when asked for, come in each API's own shape (`Logprobs`): a completion's
``{tokens, token_logprobs, top_logprobs, text_offset}`` (the top dict holds the chosen token too,
as vLLM's does, so lm-evaluation-harness can tell greedy tokens), a chat's ``{content: [{token,
logprob, bytes, top_logprobs}]}``; a stream's chunks carry their own tokens' entries.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from trtssd.sampling import TokenLogprob
from trtssd.runtime.output_processor import RequestOutput
from trtssd.serving.openai_requests import GenerationRequest, Endpoint

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ResponseHeader:
    """The fields every response and chunk of one request repeats."""

    id: str
    created: int
    model: str
    endpoint: Endpoint

    @classmethod
    def new(cls, endpoint: Endpoint, model: str) -> "ResponseHeader":
        prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, endpoint)

    def fields(self, chunk: bool) -> dict:
        if self.endpoint is Endpoint.CHAT:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class Logprobs:
    """One request's logprobs in its API's shape, chunk after chunk (a completion's
    ``text_offset`` runs on across a stream). ``token_text`` decodes one token id."""

    def __init__(self, endpoint: Endpoint, token_text: Callable[[int], str]):
        self.endpoint = endpoint
        self.token_text = token_text
        self.offset = 0  # characters of token text before the next token (text_offset)

    def payload(self, entries: Sequence[TokenLogprob]) -> dict:
        if self.endpoint is Endpoint.CHAT:
            return {"content": [{**self._chat_item(e.token_id, e.logprob),
                                 "top_logprobs": [self._chat_item(t, lp) for t, lp in e.top]} for e in entries]}
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{**{self.token_text(t): lp for t, lp in e.top}, text: e.logprob}
                                 for e, text in zip(entries, tokens)],
                "text_offset": offsets}

    def _chat_item(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def full_response(header: ResponseHeader, req: GenerationRequest, final: RequestOutput,
                  logprobs: Logprobs | None = None) -> dict:
    """The non-streaming answer (``logprobs``: when the request asked for them)."""
    lp = None if logprobs is None else logprobs.payload(final.logprobs)
    if header.endpoint is Endpoint.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": final.text}, "logprobs": lp,
                  "finish_reason": final.finish_reason}
    else:
        choice = {"index": 0, "text": final.text, "logprobs": lp, "finish_reason": final.finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(final.token_ids)
    out = {**header.fields(chunk=False), "choices": [choice], "usage": final.usage}
    if req.return_token_ids:
        out["prompt_token_ids"] = list(req.prompt)
    return out


def chunk(header: ResponseHeader, req: GenerationRequest, text: str, token_ids=None, finish_reason=None,
          role: bool = False, logprobs: dict | None = None) -> dict:
    """One streamed choice: new tokens' text (and ids and logprobs when asked for), or the finish
    reason alone."""
    if header.endpoint is Endpoint.CHAT:
        closing = finish_reason is not None and not text
        delta = {"role": "assistant", "content": text} if role else ({} if closing else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids or ())
    out = {**header.fields(chunk=True), "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(header: ResponseHeader, final: RequestOutput) -> dict:
    return {**header.fields(chunk=True), "choices": [], "usage": final.usage}
