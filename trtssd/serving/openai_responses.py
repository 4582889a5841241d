"""OpenAI response bodies and Server-Sent Events, for /v1/completions and /v1/chat/completions.

Shapes as OpenAI (and vLLM) send them, so unchanged clients and benchmarks parse them: a
completion has ``choices[0].text``, a chat completion ``choices[0].message``; stream chunks carry
``choices[0].text`` or ``choices[0].delta``; with ``stream_options.include_usage`` every chunk has
``"usage": null`` and one more chunk with ``"choices": []`` carries the usage. Streams end with
``data: [DONE]``.

Logprobs, when asked for, come in each API's own shape: a completion's ``{tokens,
token_logprobs, top_logprobs, text_offset}`` (the top dict holds the chosen token too, as vLLM's
does, so lm-evaluation-harness can tell greedy tokens), a chat's ``{content: [{token, logprob,
bytes, top_logprobs}]}``; a stream's chunks carry their own tokens' entries.

A completion with ``echo`` starts its text with the prompt's, and its logprobs (when asked) with
the prompt's tokens: the first one's logprob and top_logprobs null, as OpenAI and vLLM send them
(nothing scores it). vLLM's ``prompt_logprobs`` comes as its list: null for the first token, then
``{token_id: {logprob, rank, decoded_token}}`` for the token and its alternatives, on the choice
of a completion and at the top of a chat completion. A stream sends the echoed prompt (and the
prompt's logprobs) in a chunk of its own before the first tokens'.

A token the processed distribution gives no mass (an echoed prompt token outside top-k, or one
that min_tokens holds back) has logprob -inf, which JSON cannot carry: it is sent as
`MIN_LOGPROB` (-9999.0, vLLM's value for it).

A request for ``n`` samples gets ``n`` choices, ``index`` 0..n-1, each built as a one-sample answer
is (its own text offsets and tool calls); a stream's chunks carry their choice's ``index``, each
choice's role chunk (chat) and echoed prompt coming before its first tokens and its finish reason
once the request is done. Usage counts the prompt once and every choice's tokens, as OpenAI's.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Sequence

from trtssd.text.output_processor import CompletionOutput, Delta, RequestOutput
from trtssd.sampling import TokenLogprob
from trtssd.serving.openai_requests import Endpoint, GenerationRequest
from trtssd.structured.tools import ToolCall, ToolStreamParser, parse_tool_calls

DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # a logprob of -inf as sent (JSON has no infinity; vLLM sends this value)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Responder:
    """The bodies of one request's answer: the whole response, or its stream's chunks in order (a
    completion's logprobs ``text_offset`` runs on from chunk to chunk, per choice)."""

    def __init__(self, req: GenerationRequest, model: str, tokenizer):
        self.req = req
        self.chat = req.endpoint is Endpoint.CHAT
        self._tokenizer = tokenizer
        self._id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self._created = int(time.time())
        self._model = model
        self._offsets: dict[int, int] = {}  # per choice: characters of token text before its next token (text_offset)
        # A chat with tools: each choice's text split into content and calls as it streams.
        self._parsing = req.tool_parsing if self.chat else None
        self._tools: dict[int, ToolStreamParser] = {}

    def full(self, final: RequestOutput) -> dict:
        """The non-streaming answer: one choice per sample."""
        choices = [self._full_choice(final, output) for output in final.outputs]
        out = {**self._fields(chunk=False), "choices": choices, "usage": final.usage}
        if self.req.return_token_ids:
            out["prompt_token_ids"] = list(self.req.prompt)
        self._add_prompt_logprobs(out, final.prompt_logprobs)
        return out

    def _full_choice(self, final: RequestOutput, output: CompletionOutput) -> dict:
        req, text, lp, index = self.req, output.text, None, output.index
        if req.echo:  # the prompt's part comes first: its text offsets start at 0
            text = req.prompt_text + text
            lp = self._echoed_logprobs(final.prompt_logprobs, index)
        if req.logprobs is not None:
            generated = self._logprobs(output.logprobs, index)
            lp = generated if lp is None else {key: lp[key] + generated[key] for key in lp}
        content = {"message": self._message(text)} if self.chat else {"text": text}
        finish_reason = output.finish_reason
        if self.chat and content["message"].get("tool_calls"):
            finish_reason = _calls_finish(finish_reason)
        return self._choice(content, lp, finish_reason, output.token_ids, index)

    def role_chunks(self) -> list[dict]:
        """A chat stream's first chunks: each choice's role."""
        return [self.chunk(role=True, index=index) for index in range(self.req.params.n)]

    def prompt_chunk(self, entries: Sequence[TokenLogprob | None] | None, index: int = 0) -> dict | None:
        """A choice's first chunk when the request echoes its prompt or asks for prompt_logprobs:
        the prompt's text (echo), its tokens' logprobs (echo with logprobs), vLLM's prompt_logprobs;
        None when it does neither. ``entries``: the choice's first delta's prompt logprobs."""
        req = self.req
        if not req.echo and req.prompt_logprobs is None:
            return None
        lp = self._echoed_logprobs(entries, index) if req.echo else None
        out = self.chunk(req.prompt_text if req.echo else "", logprobs=lp, index=index)
        self._add_prompt_logprobs(out, entries)
        return out

    def delta_chunks(self, delta: Delta) -> list[dict]:
        """A step's chunks of one choice: its tokens' text (and ids and logprobs when asked for);
        with tools, the text outside calls, then each call completed by these tokens."""
        index = delta.index
        logprobs = self._logprobs(delta.logprobs, index)
        tools = self._tool_parser(index)
        if tools is None:
            return [self.chunk(delta.text, delta.token_ids, logprobs=logprobs, index=index)]
        pieces = tools.feed(delta.text)
        return [self.chunk(_text_of(pieces), delta.token_ids, logprobs=logprobs, index=index),
                *self._call_chunks(pieces, index)]

    def closing_chunks(self, finish_reason: str, index: int = 0) -> list[dict]:
        """A choice's last chunks: what the tool parser held (text, an unclosed call), then the
        finish reason ("tool_calls" where calls were made)."""
        tools = self._tool_parser(index)
        if tools is None:
            return [self.chunk(finish_reason=finish_reason, index=index)]
        pieces = tools.finish()
        out = [self.chunk(_text_of(pieces), index=index)] if _text_of(pieces) else []
        out += self._call_chunks(pieces, index)
        reason = _calls_finish(finish_reason) if tools.num_calls else finish_reason
        return out + [self.chunk(finish_reason=reason, index=index)]

    def _tool_parser(self, index: int) -> ToolStreamParser | None:
        """Choice ``index``'s stream parser of tool calls (None: a request without tools)."""
        if self._parsing is None:
            return None
        if index not in self._tools:
            self._tools[index] = self._parsing.format.stream_parser(self._parsing.max_calls)
        return self._tools[index]

    def chunk(self, text: str = "", token_ids=(), finish_reason: str | None = None, role: bool = False,
              logprobs: dict | None = None, tool_calls: list[dict] | None = None, index: int = 0) -> dict:
        """One streamed choice: new tokens' text (and ids and logprobs when asked for), the chat's
        role, tool calls, or the finish reason alone."""
        if self.chat:
            closing = finish_reason is not None and not text
            delta = {"role": "assistant", "content": text} if role else ({} if closing else {"content": text})
            if tool_calls:
                delta = {"tool_calls": tool_calls}
            content = {"delta": delta}
        else:
            content = {"text": text}
        out = {**self._fields(chunk=True), "choices": [self._choice(content, logprobs, finish_reason, token_ids, index)]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, final: RequestOutput) -> dict:
        return {**self._fields(chunk=True), "choices": [], "usage": final.usage}

    def _fields(self, chunk: bool) -> dict:
        """What every response and chunk of the request repeats."""
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self._id, "object": obj, "created": self._created, "model": self._model}

    def _choice(self, content: dict, logprobs: dict | None, finish_reason: str | None, token_ids,
                index: int) -> dict:
        choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def _message(self, text: str) -> dict:
        """A chat answer's message: its text, or with tools the text outside calls and the calls."""
        if self.req.tool_parsing is None:
            return {"role": "assistant", "content": text}
        parsed = parse_tool_calls(text, self.req.tool_parsing.format, self.req.tool_parsing.max_calls)
        message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [call.as_openai() for call in parsed.calls]
        return message

    def _call_chunks(self, pieces, index: int) -> list[dict]:
        """One chunk per call completed, each ``delta.tool_calls`` item with its index (the call's
        place in the answer), id, name and whole arguments."""
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        first = self._tools[index].num_calls - len(calls)
        return [self.chunk(tool_calls=[call.as_openai(first + i)], index=index) for i, call in enumerate(calls)]

    def _token_text(self, token_id: int) -> str:
        """One token's text, as logprobs name it (vLLM's "token_id:N" without a tokenizer)."""
        return f"token_id:{token_id}" if self._tokenizer is None else self._tokenizer.decode([token_id])

    # --- logprobs --------------------------------------------------------------------------------

    def _logprobs(self, entries: Sequence[TokenLogprob], index: int) -> dict | None:
        """Choice ``index``'s output tokens' logprobs in the API's shape; None when the request did
        not ask for them."""
        if self.req.logprobs is None:
            return None
        if self.chat:
            return {"content": [{**self._chat_item(e.token_id, e.logprob),
                                 "top_logprobs": [self._chat_item(t, lp) for t, lp in e.top]} for e in entries]}
        return self._completion_logprobs([(e.token_id, e) for e in entries], index)

    def _echoed_logprobs(self, entries: Sequence[TokenLogprob | None], index: int) -> dict | None:
        """An echoed prompt's tokens in a completion's shape (a None entry: logprob and top null)."""
        return (None if self.req.logprobs is None
                else self._completion_logprobs(list(zip(self.req.prompt, entries)), index))

    def _completion_logprobs(self, items: list[tuple[int, TokenLogprob | None]], index: int) -> dict:
        # Alternatives per token: the request's logprobs (an echoed prompt may be scored with more).
        num_top = self.req.logprobs
        tokens = [self._token_text(t) for t, _ in items]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self._offsets.get(index, 0)))
        self._offsets[index] = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [None if e is None else _sent(e.logprob) for _, e in items],
                "top_logprobs": [None if e is None else
                                 {**{self._token_text(t): lp for t, lp in e.top[:num_top]}, text: _sent(e.logprob)}
                                 for (_, e), text in zip(items, tokens)],
                "text_offset": offsets}

    def _chat_item(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": _sent(logprob), "bytes": list(text.encode("utf-8"))}

    def _add_prompt_logprobs(self, out: dict, entries: Sequence[TokenLogprob | None] | None) -> None:
        """vLLM's prompt_logprobs where the request asked: on a completion's choice, at a chat's top.
        Per prompt token, None (the first) or {token id: {logprob, rank, decoded_token}} for the
        token itself and then its alternatives."""
        num_top = self.req.prompt_logprobs
        if num_top is None or entries is None:
            return

        def item(token_id: int, logprob: float, rank: int) -> dict:
            return {"logprob": _sent(logprob), "rank": rank, "decoded_token": self._token_text(token_id)}

        listed: list[dict | None] = []
        for e in entries:
            scored = None
            if e is not None:
                scored = {str(e.token_id): item(e.token_id, e.logprob, e.rank)}
                for rank, (t, lp) in enumerate(e.top[:num_top], start=1):
                    scored.setdefault(str(t), item(t, lp, rank))
            listed.append(scored)
        for holder in [out] if self.chat else out["choices"]:
            holder["prompt_logprobs"] = listed


def _sent(logprob: float) -> float:
    """A logprob as JSON carries it: -inf as MIN_LOGPROB (top alternatives never hold -inf)."""
    return max(logprob, MIN_LOGPROB)


def _text_of(pieces) -> str:
    return "".join(p.text for p in pieces if not isinstance(p, ToolCall))


def _calls_finish(finish_reason: str) -> str:
    """A finished answer that made calls ends with "tool_calls", as OpenAI's; "length" stays."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
