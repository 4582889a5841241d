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

A completion with ``echo`` starts its text with the prompt's, and its logprobs (when asked) with
the prompt's tokens: the first one's logprob and top_logprobs null, as OpenAI and vLLM send them
(nothing scores it). vLLM's ``prompt_logprobs`` comes as its list: null for the first token, then
``{token_id: {logprob, rank, decoded_token}}`` for the token and its alternatives, on the choice
of a completion and at the top of a chat completion. A stream sends the echoed prompt (and the
prompt's logprobs) in a chunk of its own before the first tokens'.
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

    def __init__(self, endpoint: Endpoint, token_text: Callable[[int], str], num_top: int | None = None):
        self.endpoint = endpoint
        self.token_text = token_text
        # Alternatives per token: the request's logprobs (an echoed prompt may be scored with more).
        self.num_top = num_top
        self.offset = 0  # characters of token text before the next token (text_offset)

    def payload(self, entries: Sequence[TokenLogprob]) -> dict:
        if self.endpoint is Endpoint.CHAT:
            return {"content": [{**self._chat_item(e.token_id, e.logprob),
                                 "top_logprobs": [self._chat_item(t, lp) for t, lp in e.top]} for e in entries]}
        return self._completion([(e.token_id, e) for e in entries])

    def prompt_payload(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
        """An echoed prompt's tokens in a completion's shape (a None entry: logprob and top null)."""
        return self._completion(list(zip(token_ids, entries)))

    def _completion(self, items: list[tuple[int, TokenLogprob | None]]) -> dict:
        tokens = [self.token_text(t) for t, _ in items]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for _, e in items],
                "top_logprobs": [None if e is None else
                                 {**{self.token_text(t): lp for t, lp in e.top[:self.num_top]}, text: e.logprob}
                                 for (_, e), text in zip(items, tokens)],
                "text_offset": offsets}

    def _chat_item(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def joined(first: dict, then: dict) -> dict:
    """Two completion logprobs payloads as one (an echoed prompt's, then the output's)."""
    return {key: first[key] + then[key] for key in first}


def prompt_logprobs_list(entries: Sequence[TokenLogprob | None], token_text: Callable[[int], str],
                         num_top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and then its ``num_top`` alternatives."""
    def item(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        scored = {str(e.token_id): item(e.token_id, e.logprob, e.rank)}
        for rank, (t, lp) in enumerate(e.top[:num_top], start=1):
            scored.setdefault(str(t), item(t, lp, rank))
        out.append(scored)
    return out


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def full_response(header: ResponseHeader, req: GenerationRequest, final: RequestOutput,
                  logprobs: Logprobs | None = None, token_text: Callable[[int], str] = str) -> dict:
    """The non-streaming answer (``logprobs``: when the request asked for them; ``token_text``
    decodes one token id, for prompt_logprobs)."""
    text, lp = final.text, None
    if req.echo:  # the prompt's part comes first: its text offsets start at 0
        text = req.prompt_text + text
        lp = None if logprobs is None else logprobs.prompt_payload(req.prompt, final.prompt_logprobs)
    if logprobs is not None:
        lp = logprobs.payload(final.logprobs) if lp is None else joined(lp, logprobs.payload(final.logprobs))
    if header.endpoint is Endpoint.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                  "finish_reason": final.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": final.finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(final.token_ids)
    out = {**header.fields(chunk=False), "choices": [choice], "usage": final.usage}
    if req.return_token_ids:
        out["prompt_token_ids"] = list(req.prompt)
    _add_prompt_logprobs(out, req, final.prompt_logprobs, token_text)
    return out


def prompt_chunk(header: ResponseHeader, req: GenerationRequest, entries: Sequence[TokenLogprob | None] | None,
                 logprobs: Logprobs | None, token_text: Callable[[int], str]) -> dict | None:
    """A stream's first chunk when the request echoes its prompt or asks for prompt_logprobs:
    the prompt's text (echo), its tokens' logprobs (echo with logprobs), vLLM's prompt_logprobs;
    None when it does neither. ``entries``: the first delta's prompt logprobs."""
    if not req.echo and req.prompt_logprobs is None:
        return None
    lp = logprobs.prompt_payload(req.prompt, entries) if req.echo and logprobs is not None else None
    out = chunk(header, req, req.prompt_text if req.echo else "", logprobs=lp)
    _add_prompt_logprobs(out, req, entries, token_text)
    return out


def _add_prompt_logprobs(out: dict, req: GenerationRequest, entries: Sequence[TokenLogprob | None] | None,
                         token_text: Callable[[int], str]) -> None:
    """vLLM's prompt_logprobs where the request asked: on a completion's choice, at a chat's top."""
    if req.prompt_logprobs is None or entries is None:
        return
    listed = prompt_logprobs_list(entries, token_text, req.prompt_logprobs)
    if req.endpoint is Endpoint.CHAT:
        out["prompt_logprobs"] = listed
    else:
        out["choices"][0]["prompt_logprobs"] = listed


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
