"""OpenAI request bodies -> what the engine runs: token ids and SamplingParams, checked field by
field.

Every field is either supported, accepted only at its neutral value (``n`` = 1, ``echo``
off, penalties 0, ...: features we do not have are refused, never ignored), or unknown and
refused. Each refusal is an `ApiError` naming the field and what is allowed; range checks are
SamplingParams' own messages. JSON null means "not given", as OpenAI clients send it.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from trtssd.models.tokenizer import chat_prompt_ids, encode_text
from trtssd.sampling import MAX_LOGPROBS, SamplingParams

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


class Kind(str, enum.Enum):
    COMPLETION = "completion"  # POST /v1/completions
    CHAT = "chat"  # POST /v1/chat/completions


@dataclass(frozen=True)
class ModelInfo:
    """What parsing needs to know about the served model."""

    name: str  # the served model name; a request naming another model gets 404
    tokenizer: object | None  # transformers tokenizer; None = prompts must be token ids
    max_model_len: int  # prompt + output tokens per request (RuntimeConfig.max_seq_len)


@dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool  # vLLM's extension: token ids in every choice


# Fields taken as they come (sampling, streaming, bookkeeping).
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
           "ignore_eos", "stream", "stream_options", "user", "return_token_ids")
_SUPPORTED = {Kind.COMPLETION: _COMMON + ("prompt", "logprobs"),
              Kind.CHAT: _COMMON + ("messages", "max_completion_tokens", "logprobs", "top_logprobs")}

# Fields of features we do not have: accepted only at the value that turns them off.
_NEUTRAL = {
    Kind.COMPLETION: {"n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",),
                      "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
                      "logit_bias": ({},)},
    Kind.CHAT: {"n": (1,), "frequency_penalty": (0, 0.0),
                "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "logit_bias": ({},), "tools": ([],),
                "tool_choice": ("none",), "response_format": ({"type": "text"},)},
}

_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object; got {type(body).__name__}")
    return body


def parse_request(kind: Kind, body: dict, model: ModelInfo) -> GenerationRequest:
    """Check every field of ``body`` and turn it into a `GenerationRequest` (raises ApiError)."""
    body = {k: v for k, v in body.items() if v is not None}
    _check_fields(kind, body)
    _typed(body, "user", str, "a string")  # an end-user id for the caller's own logs: checked, not used
    if "model" in body and _typed(body, "model", str, "a string") != model.name:
        raise ApiError(404, f"The model `{body['model']}` does not exist; this server serves `{model.name}`.", "model")
    prompt = _chat_prompt(body, model) if kind is Kind.CHAT else _completion_prompt(body, model)
    stream = _typed(body, "stream", bool, "a boolean", False)
    include_usage = _stream_options(body, stream)
    params = _sampling_params(kind, body, prompt, model)
    _check_length(kind, prompt, params.max_tokens, model)
    return GenerationRequest(kind, prompt, params, stream, include_usage,
                             _typed(body, "return_token_ids", bool, "a boolean", False))


def _check_length(kind: Kind, prompt: list[int], max_tokens: int, model: ModelInfo) -> None:
    total = len(prompt) + max_tokens
    if total > model.max_model_len:
        too_long = len(prompt) >= model.max_model_len
        field = ("messages" if kind is Kind.CHAT else "prompt") if too_long else "max_tokens"
        raise ApiError(400, f"this model's maximum context length is {model.max_model_len} tokens; the request "
                            f"asks for {total} ({len(prompt)} in the prompt, {max_tokens} to generate)", field)


def _check_fields(kind: Kind, body: dict) -> None:
    supported, neutral = _SUPPORTED[kind], _NEUTRAL[kind]
    for name, value in body.items():
        if name in supported:
            continue
        if name in neutral:
            if not any(type(value) is type(ok) and value == ok for ok in neutral[name]):
                allowed = " or ".join(json.dumps(ok) for ok in neutral[name]) or "null"
                raise ApiError(400, f"'{name}' is not supported: it must be {allowed} (or absent); "
                                    f"got {json.dumps(value)}", name)
            continue
        raise ApiError(400, f"unknown field '{name}'; supported fields: {', '.join(sorted(supported))}", name)


def _typed(body: dict, name: str, types, what: str, default=None):
    """body[name] when it has one of ``types`` (bool is not a number here), else ApiError."""
    if name not in body:
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"'{name}' must be {what}; got {json.dumps(value)}", name)
    if not isinstance(value, types):
        raise ApiError(400, f"'{name}' must be {what}; got {json.dumps(value)}", name)
    return value


def _is_token_ids(value) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _completion_prompt(body: dict, model: ModelInfo) -> list[int]:
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required: a string or a list of token ids", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one: ["text"] or [[ids]]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"'prompt' must be one prompt (a string or a list of token ids); batches of "
                            f"{len(prompt)} are not supported: send one request per prompt", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
        if model.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as a list of token ids", "prompt")
        return encode_text(model.tokenizer, prompt)
    if not _is_token_ids(prompt):
        raise ApiError(400, "'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
    return list(prompt)


def _chat_prompt(body: dict, model: ModelInfo) -> list[int]:
    if "messages" not in body:
        raise ApiError(400, "'messages' is required: a list of {'role', 'content'} objects", "messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    plain = [_message(i, m) for i, m in enumerate(messages)]
    if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
    try:
        return chat_prompt_ids(model.tokenizer, plain)
    except Exception as err:  # noqa: BLE001 - the template's own complaint (e.g. role order) is the message
        raise ApiError(400, f"the chat template rejected 'messages': {err}", "messages") from None


def _message(i: int, message) -> dict:
    """One message as {'role', 'content': str}; content parts must be text."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"'{where}' must be an object with a 'role' string and a 'content'", "messages")
    if message["role"] not in _ROLES:
        raise ApiError(400, f"'{where}.role' must be one of {', '.join(_ROLES)}; got {json.dumps(message['role'])}",
                       "messages")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"'{where}.content' parts must be {{'type': 'text', 'text': ...}}: only text is "
                                "supported", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"'{where}.content' must be a string or a list of text parts", "messages")
    return {"role": message["role"], "content": content}


def _stream_options(body: dict, stream: bool) -> bool:
    options = _typed(body, "stream_options", dict, "an object")
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    unknown = set(options) - {"include_usage"}
    if unknown:
        raise ApiError(400, f"unknown 'stream_options' field(s) {sorted(unknown)}; supported: include_usage",
                       "stream_options")
    return _typed(options, "include_usage", bool, "a boolean", True)  # default True when the object is given


def _logprobs(kind: Kind, body: dict) -> int | None:
    """SamplingParams.logprobs from OpenAI's fields: a completion's ``logprobs`` is the number of
    alternatives per token; a chat's ``logprobs`` turns them on and ``top_logprobs`` counts them."""
    if kind is Kind.COMPLETION:
        return _typed(body, "logprobs", int, "an integer")  # its range: SamplingParams' message
    top = _typed(body, "top_logprobs", int, "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}]; got {top}", "top_logprobs")
    if not _typed(body, "logprobs", bool, "a boolean", False):
        if top:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def _sampling_params(kind: Kind, body: dict, prompt: list[int], model: ModelInfo) -> SamplingParams:
    number = (int, float)
    max_tokens = _typed(body, "max_tokens", int, "an integer")
    if kind is Kind.CHAT:
        max_tokens = _typed(body, "max_completion_tokens", int, "an integer", max_tokens)
        if max_tokens is None:  # OpenAI's chat default: as many as the context leaves
            max_tokens = model.max_model_len - len(prompt)
            if max_tokens < 1:
                raise ApiError(400, f"the messages take {len(prompt)} tokens: no room for output within "
                                    f"max_seq_len {model.max_model_len}", "messages")
    elif max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    top_k = _typed(body, "top_k", int, "an integer", 0)
    stop = _typed(body, "stop", (str, list), "a string or a list of strings", ())
    options = dict(
        max_tokens=max_tokens,
        temperature=_typed(body, "temperature", number, "a number", 1.0),
        top_p=_typed(body, "top_p", number, "a number", 1.0),
        top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's "off", 0 ours
        min_p=_typed(body, "min_p", number, "a number", 0.0),
        seed=_typed(body, "seed", int, "an integer"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(_typed(body, "stop_token_ids", list, "a list of integers", ())),
        ignore_eos=_typed(body, "ignore_eos", bool, "a boolean", False),
        logprobs=_logprobs(kind, body),
    )
    try:
        return SamplingParams(**options)
    except ValueError as err:  # the range, from SamplingParams itself: "SamplingParams.top_p must be ..."
        field = re.match(r"SamplingParams\.(\w+)", str(err))
        raise ApiError(400, str(err), field.group(1) if field else None) from None
