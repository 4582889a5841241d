"""OpenAI request bodies -> what the engine runs: token ids and SamplingParams.

`CompletionRequest` and `ChatCompletionRequest` are pydantic models with one field per OpenAI
parameter we take: FastAPI checks each body against them, and /openapi.json documents every
field with its allowed values. A field is supported, or accepted only at the value that turns
it off (``best_of`` = 1, ``suffix`` "", ...: features we do not have are refused, never
ignored); any other field is refused. JSON null means "not given", as OpenAI clients send it.
What a field's type cannot say (one field that needs another, the model's tokenizer) is checked
in `to_generation_request`, and the prompt + max_tokens length by the engine at submit.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, Field, model_validator

from trtssd.models.tokenizer import chat_prompt_ids, encode_text
from trtssd.sampling import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_PENALTY, MAX_REPETITION_PENALTY,
                             MIN_REPETITION_PENALTY, MIN_TEMPERATURE, SamplingParams)
from trtssd.serving.openai_body import ApiError, Body, ErrorInfo, ErrorResponse  # noqa: F401 - re-exported
from trtssd.serving.openai_structured import Structured, StructuredFields, ToolFields, ToolParsing
from trtssd.structured.tools import template_tool_calls

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_SEED = 2**63 - 1  # SamplingParams' limit (a torch.Generator seed)
# Most logit_bias entries a request may send: a bound on what one request makes every step do
# (the bias itself is one dense vector); far more than banning or favouring a few words takes.
MAX_LOGIT_BIAS_ENTRIES = 1024


class Endpoint(str, enum.Enum):
    COMPLETION = "completion"  # POST /v1/completions
    CHAT = "chat"  # POST /v1/chat/completions


@dataclass(frozen=True)
class ModelInfo:
    """What parsing needs to know about the served model."""

    name: str  # the served model name; a request naming another model gets 404
    tokenizer: object | None  # transformers tokenizer; None = prompts must be token ids
    max_model_len: int  # prompt + output tokens per request


@dataclass(frozen=True)
class GenerationRequest:
    endpoint: Endpoint
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool  # vLLM's extension: token ids in every choice
    max_tokens_param: str | None = None  # the output length's field as sent; None: not sent (a default)
    echo: bool = False  # completions: the answer's text (and logprobs) start with the prompt's
    prompt_text: str = ""  # the prompt as text, for echo: as sent, or its token ids decoded
    logprobs: int | None = None  # what the request's own logprobs field asked (params may ask more for echo)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field, as sent
    constraint_param: str | None = None  # the field params.constraint came from, as sent
    tool_parsing: ToolParsing | None = None  # chat: tool calls to parse out of the answer

    def error_param(self, err: ValueError) -> str:
        """The request field that an engine `ValueError` (at submit) is about, by the name the user
        sent: the engine names only its own ``field``, "prompt", "max_tokens" or "constraint",
        when it has one."""
        field = getattr(err, "field", None)
        if field == "max_tokens" and self.max_tokens_param is not None:
            return self.max_tokens_param
        if field == "constraint" and self.constraint_param is not None:
            return self.constraint_param
        if field in ("n", "logit_bias", "stop_token_ids"):  # n above the running batch; an id outside the vocabulary
            return field
        return "messages" if self.endpoint is Endpoint.CHAT else "prompt"


# --- the request bodies --------------------------------------------------------------------------
# Each field's description starts with the values it allows: error messages quote it.

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
OFF = "or null: the feature is not supported, only the value that turns it off is accepted"


class StreamOptions(Body):
    include_usage: Optional[bool] = Field(True, description="a boolean: a last chunk with the usage")


class TextPart(Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(Body):
    name: str
    arguments: Union[str, dict[str, Any]] = Field(description="the arguments as JSON text (OpenAI's) or an object")


class MessageToolCall(Body):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None  # may be left out by an assistant message with tool_calls
    tool_calls: Optional[list[MessageToolCall]] = None  # assistant: the calls it made
    tool_call_id: Optional[str] = None  # tool: the call this message answers

    @model_validator(mode="after")
    def _content_or_calls(self) -> "Message":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only an assistant message has 'tool_calls'; this one's role is {self.role!r}")
        if self.content is None and not self.tool_calls:
            raise ValueError("'content' is required (an assistant message may send 'tool_calls' instead)")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: text content, tool calls' arguments as objects."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = template_tool_calls(c.model_dump() for c in self.tool_calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _Common(StructuredFields):
    """The fields both routes take. Each route's model adds its prompt and the methods
    `prompt_ids`, `output_length` and `logprobs_count` (SamplingParams.logprobs)."""

    endpoint: ClassVar[Endpoint]

    model: Optional[str] = Field(None, description="a string: the served model's name (GET /v1/models)")
    temperature: Optional[float] = Field(1.0, ge=0, description=f"0 (greedy) or a number >= {MIN_TEMPERATURE}")
    top_p: Optional[float] = Field(1.0, gt=0, le=1, description="a number in (0, 1]; 1 = off")
    top_k: Optional[int] = Field(0, ge=-1, description="an integer >= -1; -1 or 0 = off")
    min_p: Optional[float] = Field(0.0, ge=0, lt=1, description="a number in [0, 1); 0 = off")
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED, description=f"an integer in [0, {MAX_SEED}]")
    stop: Optional[Union[NonEmptyStr, list[NonEmptyStr]]] = Field(
        None, description="a non-empty string or a list of them: the text ends before the first one")
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = Field(
        None, description="a list of token ids (integers >= 0): the output ends after the first one")
    ignore_eos: Optional[bool] = Field(False, description="a boolean: go on past the end-of-sequence token")
    stream: Optional[bool] = Field(False, description="a boolean: send the output as Server-Sent Events")
    stream_options: Optional[StreamOptions] = Field(None, description="an object {include_usage}, with stream: true")
    user: Optional[str] = Field(None, description="a string: an end-user id for the caller's own logs (unused)")
    return_token_ids: Optional[bool] = Field(False, description="a boolean: token ids in the answer (vLLM's)")
    n: Optional[int] = Field(
        None, ge=1, le=MAX_N, description=f"an integer in [1, {MAX_N}], and at most the server's max_batch: how many "
        "samples (choices) of the prompt to generate, the prompt prefilled once")
    frequency_penalty: Optional[float] = Field(
        0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, description=f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]: each "
        "token's logit lowered by this times its count in the output so far; 0 = off")
    presence_penalty: Optional[float] = Field(
        0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, description=f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]: the "
        "logit of each token the output holds so far lowered by this; 0 = off")
    repetition_penalty: Optional[float] = Field(
        1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, description=f"a number in "
        f"[{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (vLLM's): the logits of the prompt's and output's "
        "tokens divided by it where positive, multiplied where not; 1 = off")
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]] = Field(
        None, max_length=MAX_LOGIT_BIAS_ENTRIES, description=f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids "
        f"(as strings) to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], added to those tokens' logits")
    min_tokens: Optional[int] = Field(
        0, ge=0, description="an integer >= 0, at most the output length (vLLM's): no end-of-sequence or stop token "
        "before the output has this many tokens")
    prompt_logprobs: Optional[int] = Field(
        None, ge=0, le=MAX_LOGPROBS, description=f"an integer in [0, {MAX_LOGPROBS}]: each prompt token's logprob "
        "and this many alternatives, as vLLM's 'prompt_logprobs' list (the first token's entry null)")

    def to_generation_request(self, model: ModelInfo) -> GenerationRequest:
        """What the engine runs; ApiError for what the fields' own types cannot check."""
        if self.model is not None and self.model != model.name:
            raise ApiError(404, f"The model `{self.model}` does not exist; this server serves `{model.name}`.", "model")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        self.check_combinations()
        structured = self.structured(model.tokenizer)
        prompt = self.prompt_ids(model, structured)
        echoed = self.echoed_prompt(prompt, model)
        logprobs = self.logprobs_count()
        # Echoed logprobs cover the prompt too: the prompt is scored with as many alternatives.
        scored = [n for n in (self.prompt_logprobs, logprobs if echoed is not None else None) if n is not None]
        try:
            params = SamplingParams(
                max_tokens=self.output_length(prompt, model), temperature=self.temperature, top_p=self.top_p,
                top_k=max(self.top_k, 0), min_p=self.min_p, seed=self.seed,  # top_k -1 is vLLM's "off", 0 ours
                stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                logprobs=logprobs, prompt_logprobs=max(scored) if scored else None, constraint=structured.constraint,
                n=self.n or 1, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias_ids(), min_tokens=self.min_tokens)
        except ValueError as err:  # a check of SamplingParams' that the fields' types do not make (yet)
            raise ApiError(400, str(err), getattr(err, "field", None)) from None
        include_usage = self.stream_options is not None and self.stream_options.include_usage
        # The engine's length error names "max_tokens": the user may have sent it by another name.
        sent = [name for name in ("max_completion_tokens", "max_tokens") if name in self.model_fields_set]
        return GenerationRequest(self.endpoint, prompt, params, self.stream, include_usage, self.return_token_ids,
                                 sent[0] if sent else None, echoed is not None, echoed or "", logprobs,
                                 self.prompt_logprobs, structured.param, structured.parsing)

    def echoed_prompt(self, prompt: list[int], model: ModelInfo) -> str | None:
        """The prompt's text when the answer starts with it (a completion's echo), else None."""
        return None

    def check_combinations(self) -> None:
        """ApiError for fields that each hold an allowed value but not together (a route's own)."""

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias by token id (a JSON object's keys are strings); whether each id is in the
        vocabulary is the engine's check at submit."""
        given = self.logit_bias or {}
        bad = [key for key in given if _token_id(key) is None]
        if bad:
            raise ApiError(400, f"'logit_bias' keys must be token ids (integers >= 0 written as strings); got "
                                f"{_show(bad[:5])}", "logit_bias")
        ids: dict[int, float] = {}
        for key, bias in given.items():
            token = _token_id(key)
            if token in ids:  # "7" and "07": one token given two biases
                raise ApiError(400, f"'logit_bias' names token {token} more than once (key {key!r}); give each "
                                    "token id one bias", "logit_bias")
            ids[token] = bias
        return ids


class CompletionRequest(_Common):
    """POST /v1/completions."""

    endpoint: ClassVar[Endpoint] = Endpoint.COMPLETION

    prompt: Union[NonEmptyStr, TokenIds, Annotated[list[NonEmptyStr], Field(min_length=1, max_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=1)]] = Field(
        description="a non-empty string or a non-empty list of token ids, or a batch of one of those "
                    "(larger batches are not supported: send one request per prompt)")
    max_tokens: Optional[int] = Field(
        COMPLETION_DEFAULT_MAX_TOKENS, ge=0,
        description="an integer >= 0; 0 generates nothing (with echo and logprobs: scores the prompt, as vLLM)")
    logprobs: Optional[int] = Field(
        None, ge=0, le=MAX_LOGPROBS, description=f"an integer in [0, {MAX_LOGPROBS}]: alternatives per token "
        "(with echo: the prompt's tokens too, the first one's logprob null)")
    echo: Optional[bool] = Field(False, description="a boolean: the text (and logprobs) start with the prompt's")
    suffix: Optional[Literal[""]] = Field(None, description=f'"" {OFF}')
    best_of: Optional[Literal[1]] = Field(
        None, description="1 or null: best_of (several samples, the best returned) is not supported, as OpenAI's "
        "API no longer has it; 'n' returns several samples")

    def check_combinations(self) -> None:
        # OpenAI's and vLLM's rule: best_of samples, n of them returned, so best_of >= n.
        if self.best_of is not None and (self.n or 1) > self.best_of:
            raise ApiError(400, f"'best_of' ({self.best_of}) must be at least 'n' ({self.n}), and only 1 is supported: "
                                "leave 'best_of' out to get n samples", "best_of")

    def prompt_ids(self, model: ModelInfo, structured: Structured) -> list[int]:
        prompt = self._one_prompt()
        if isinstance(prompt, list):
            return list(prompt)
        if model.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as a list of token ids", "prompt")
        return encode_text(model.tokenizer, prompt)

    def output_length(self, prompt: list[int], model: ModelInfo) -> int:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def echoed_prompt(self, prompt: list[int], model: ModelInfo) -> str | None:
        """The text as sent; token ids decoded (nothing without a tokenizer)."""
        if not self.echo:
            return None
        sent = self._one_prompt()
        if isinstance(sent, str):
            return sent
        return "" if model.tokenizer is None else model.tokenizer.decode(prompt)

    def _one_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            return self.prompt[0]  # a batch of one: ["text"] or [[ids]]
        return self.prompt


class ChatCompletionRequest(_Common, ToolFields):
    """POST /v1/chat/completions."""

    endpoint: ClassVar[Endpoint] = Endpoint.CHAT

    messages: list[Message] = Field(
        min_length=1, description="a non-empty list of {role, content} objects: role is system, developer, user, "
        "assistant or tool; content a string or a list of {type: 'text', text} parts (only text is supported); "
        "an assistant message may carry tool_calls, a tool message its tool_call_id")
    max_tokens: Optional[int] = Field(None, ge=1, description="an integer >= 1; default: what the context leaves")
    max_completion_tokens: Optional[int] = Field(
        None, ge=1, description="an integer >= 1: max_tokens by its newer name, which wins over it")
    logprobs: Optional[bool] = Field(False, description="a boolean: each output token's logprob")
    top_logprobs: Optional[int] = Field(
        None, ge=0, le=MAX_LOGPROBS, description=f"an integer in [0, {MAX_LOGPROBS}], with logprobs: true")

    def prompt_ids(self, model: ModelInfo, structured: Structured) -> list[int]:
        if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        try:
            plain = [m.for_template() for m in self.messages]
        except ValueError as err:  # a tool call's arguments that are not JSON
            raise ApiError(400, f"'messages': {err}", "messages") from None
        try:
            return chat_prompt_ids(model.tokenizer, plain, list(structured.tools or ()))
        except Exception as err:  # noqa: BLE001 - the template's own complaint (e.g. role order) is the message
            raise ApiError(400, f"the chat template rejected 'messages': {err}", "messages") from None

    def output_length(self, prompt: list[int], model: ModelInfo) -> int:
        # OpenAI's chat default: as many as the context leaves; at least 1, so that messages that
        # leave none are refused by the engine's length check, which names them.
        return self.max_completion_tokens or self.max_tokens or max(1, model.max_model_len - len(prompt))

    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return self.top_logprobs or 0


def _token_id(key: str) -> int | None:
    """A logit_bias key as a token id: ASCII digits only (no sign, space or point); None otherwise,
    and for more digits than Python converts (any such id lies outside every vocabulary anyway)."""
    if not (key.isascii() and key.isdigit()):
        return None
    try:
        return int(key)
    except ValueError:  # past sys.get_int_max_str_digits()
        return None


# --- validation errors in OpenAI's shape ----------------------------------------------------------

def _show(value: Any, limit: int = 200) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[:limit] + "..."


def _path(loc: tuple) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def validation_error(errors: list[dict], body: Any, model: type[BaseModel] | None) -> ApiError:
    """FastAPI's RequestValidationError of a JSON body -> one 400 that names the first bad field
    (``param``) as the user spelled it, and what it allows (the field's description)."""
    first = errors[0]
    loc = tuple(first["loc"][1:]) if first["loc"][:1] == ("body",) else tuple(first["loc"])
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error')} "
                             f"(at character {loc[0] if loc else 0})")
    if not loc or model is None:
        got = ("nothing" if first["type"] == "missing" else "a body that is not JSON" if isinstance(body, bytes)
               else _show(body))
        return ApiError(400, f"the request body must be a JSON object, sent as Content-Type: application/json; "
                             f"got {got}")
    param = str(loc[0])
    if first["type"] == "extra_forbidden":
        supported = f"; supported fields: {', '.join(sorted(model.model_fields))}" if len(loc) == 1 else ""
        return ApiError(400, f"unknown field '{_path(loc)}'{supported}", param)
    description = model.model_fields[param].description
    if first["type"] == "missing" and len(loc) == 1:
        return ApiError(400, f"'{param}' is required: {description}", param)
    if len(loc) == 1 or sum(e["loc"][1:2] == (param,) for e in errors) > 1:
        # The field itself, a union's alternatives (each has its error) or several of its items:
        # say what the field takes.
        return ApiError(400, f"'{param}' must be {description}; got {_show(body[param])}", param)
    return ApiError(400, f"'{_path(loc)}': {first['msg']}; got {_show(first['input'])}", param)
