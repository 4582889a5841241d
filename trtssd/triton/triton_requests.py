"""One Triton request -> what the engine runs: prompt token ids, SamplingParams and the response
options, checked field by field (a bad field is a `ValueError` naming it: the client gets it as
an INVALID_ARG error and the model stays loaded).

Sampling settings may come three ways, later ones winning:
1. ``sampling_parameters``, a JSON object as vLLM's Triton backend takes it (numbers may be
   strings, as in vLLM's sample client); unknown keys are refused;
2. request parameters (the HTTP ``generate`` endpoints turn every key that is not an input into
   one): the sampling keys are taken, the others (``accumulate_tokens`` from ``vllm bench serve``,
   ...) are left alone;
3. the TensorRT-LLM-style scalar inputs (``max_tokens``, ``temperature``, ...).

Log-probabilities are asked for as TensorRT-LLM asks for them, with ``return_log_probs``; the
engine then computes each chosen token's value and no alternatives, since no output carries them.
vLLM's ``logprobs`` key (a number of alternatives) is checked, so its clients are not refused,
but it asks for nothing: vLLM's backend returns them only on its own ``logprobs`` output (a
JSON string with each alternative's rank and decoded text), which this model does not have.

Penalties come as vLLM's keys or TensorRT-LLM's inputs of the same names (``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``min_tokens``; TensorRT-LLM's older ``min_length``
too). TensorRT-LLM's token inputs map onto SamplingParams: ``bad_words`` (each word tokenized
without special tokens, as its preprocessing does) onto ``bad_words_ids``; ``embedding_bias`` (a
[vocab] vector) and ``embedding_bias_words`` / ``embedding_bias_weights`` (each word's tokens get
its weight) onto ``logit_bias``, so their values must lie in [-100, 100]: a ban is a bad word.

A constraint on the output comes as TensorRT-LLM's backend takes one: ``guided_decoding_guide_type``
(json, json_schema, regex, ebnf_grammar) and ``guided_decoding_guide`` (the schema, regex or
grammar). Its form is checked here; whether the grammar engine compiles it, by the model before
the request runs (an INVALID_ARG naming the input either way).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np

from trtssd.models.tokenizer import encode_text
from trtssd.sampling import MAX_LOGIT_BIAS, FieldError, SamplingParams
from trtssd.structured.constraint import Constraint, ConstraintError
from trtssd.triton.tensors import SAMPLING_INPUTS

DEFAULT_MAX_TOKENS = 16  # vLLM's (and its Triton backend's) default

# The keys of ``sampling_parameters`` and their types (vLLM's names; top_k -1 means off, as there).
SAMPLING_KEYS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
                 "seed": int, "stop": list, "stop_token_ids": list, "ignore_eos": bool, "logprobs": int,
                 "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float, "min_tokens": int}

# guided_decoding_guide_type -> how its guide becomes a Constraint (TensorRT-LLM's names).
GUIDE_TYPES = {"json": None, "json_schema": Constraint.json_schema, "regex": Constraint.regex,
               "ebnf_grammar": Constraint.grammar}
GUIDE_TYPE_INPUT, GUIDE_INPUT = "guided_decoding_guide_type", "guided_decoding_guide"


@dataclass(frozen=True)
class GenerateRequest:
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    prepend_input: bool  # put the prompt before the generated text (non-streaming only)
    return_log_probs: bool = False  # add output_log_probs and cum_log_probs to the responses


def parse_request(inputs: dict[str, np.ndarray], parameters: dict, tokenizer) -> GenerateRequest:
    """``inputs``: the request's input tensors by name; ``parameters``: its request parameters."""
    text = _text_input(inputs)
    stream = _bool(inputs, "stream", False)
    prepend_input = _prepend_input(inputs, stream)
    settings = {"max_tokens": DEFAULT_MAX_TOKENS}
    settings.update(_sampling_parameters(inputs))
    settings.update({k: _convert(k, v, "request parameter") for k, v in parameters.items() if k in SAMPLING_KEYS})
    settings.update(_scalar_inputs(inputs))
    return_log_probs = _bool(inputs, "return_log_probs", False)
    # After its checks the `logprobs` key is dropped (see above): only the flag asks the engine.
    params = dataclasses.replace(_params(settings), logprobs=0 if return_log_probs else None,
                                 constraint=_constraint(inputs), **_token_inputs(inputs, tokenizer))
    return GenerateRequest(text, _encode(text, tokenizer), params, stream, prepend_input, return_log_probs)


def _constraint(inputs: dict[str, np.ndarray]) -> Constraint | None:
    """The guided-decoding inputs as a Constraint (None without a guide type)."""
    if GUIDE_TYPE_INPUT not in inputs:
        if GUIDE_INPUT in inputs:
            raise ValueError(f"'{GUIDE_INPUT}' needs '{GUIDE_TYPE_INPUT}': one of {', '.join(GUIDE_TYPES)}")
        return None
    kind = _one_string(inputs, GUIDE_TYPE_INPUT)
    if kind == "structural_tag":
        raise ValueError(f"'{GUIDE_TYPE_INPUT}' structural_tag is not supported; supported: {', '.join(GUIDE_TYPES)}")
    if kind not in GUIDE_TYPES:
        raise ValueError(f"'{GUIDE_TYPE_INPUT}' must be one of {', '.join(GUIDE_TYPES)}; got {kind!r}")
    guide = _one_string(inputs, GUIDE_INPUT) if GUIDE_INPUT in inputs else None
    if kind == "json":
        if guide:
            raise ValueError(f"'{GUIDE_INPUT}' is not used with '{GUIDE_TYPE_INPUT}' json (any JSON object): send "
                             "json_schema to constrain the output by a schema")
        return Constraint.json_object()
    if not guide:
        raise ValueError(f"'{GUIDE_TYPE_INPUT}' {kind} needs '{GUIDE_INPUT}': the {kind.replace('_', ' ')}")
    try:
        return GUIDE_TYPES[kind](guide)
    except ConstraintError as err:
        raise ValueError(f"invalid '{GUIDE_INPUT}': {err}") from None


def _token_inputs(inputs: dict[str, np.ndarray], tokenizer) -> dict:
    """TensorRT-LLM's bad_words and embedding bias inputs as SamplingParams fields (bad_words_ids,
    logit_bias); words are tokenized without special tokens, and empty ones skipped, as its
    preprocessing model does."""
    out: dict = {}
    if "bad_words" in inputs:
        out["bad_words_ids"] = tuple(tuple(ids) for ids in _words(inputs, "bad_words", tokenizer) if ids)
    bias: dict[int, float] = {}
    if "embedding_bias" in inputs:
        values = inputs["embedding_bias"].reshape(-1).astype(np.float64)
        for token in np.flatnonzero(values):
            bias[int(token)] = float(values[token])
    if "embedding_bias_words" in inputs or "embedding_bias_weights" in inputs:
        words = _words(inputs, "embedding_bias_words", tokenizer)
        weights = inputs.get("embedding_bias_weights", np.zeros(0)).reshape(-1).astype(np.float64)
        if len(words) != len(weights):
            raise ValueError(f"'embedding_bias_weights' must hold one weight per 'embedding_bias_words' entry: got "
                             f"{len(weights)} weights for {len(words)} words")
        for ids, weight in zip(words, weights):
            for token in ids:
                bias[token] = bias.get(token, 0.0) + float(weight)
    outside = {t: b for t, b in bias.items() if not (math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS)}
    if outside:
        raise ValueError(f"'embedding_bias' values (with the embedding_bias_words weights) must be finite numbers in "
                         f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], as OpenAI's logit_bias; ban a token with "
                         f"'bad_words' instead; got {dict(list(outside.items())[:5])}")
    if bias:
        out["logit_bias"] = {t: b for t, b in bias.items() if b}
    return out


def _words(inputs: dict[str, np.ndarray], name: str, tokenizer) -> list[list[int]]:
    """Each string of a word-list input as its token ids (an empty word: no ids)."""
    words = [_string(v, name) for v in inputs.get(name, np.zeros(0, dtype=object)).reshape(-1)]
    if words and tokenizer is None:
        raise ValueError(f"this model has no tokenizer, so it cannot take '{name}'")
    return [list(tokenizer.encode(w, add_special_tokens=False)) if w else [] for w in words]


def _one_string(inputs: dict[str, np.ndarray], name: str) -> str:
    values = inputs[name].reshape(-1)
    if values.size != 1:
        raise ValueError(f"'{name}' must hold one string; got {values.size}")
    return _string(values[0], name)


def _text_input(inputs: dict[str, np.ndarray]) -> str:
    if "text_input" not in inputs:
        raise ValueError("'text_input' is required: the prompt as one string")
    values = inputs["text_input"].reshape(-1)
    if values.size != 1:
        raise ValueError(f"'text_input' must hold one string (one prompt per request); got {values.size}")
    text = _string(values[0], "text_input")
    if not text:
        raise ValueError("'text_input' must be a non-empty string")
    return text


def _prepend_input(inputs: dict[str, np.ndarray], stream: bool) -> bool:
    """vLLM's backend's rule: streamed text never repeats the prompt, and asking for it is an error."""
    if "exclude_input_in_output" not in inputs:
        return not stream
    prepend = not _bool(inputs, "exclude_input_in_output", True)
    if prepend and stream:
        raise ValueError("'exclude_input_in_output' = false is not allowed with 'stream' = true: streamed "
                         "responses carry only new text")
    return prepend


def _sampling_parameters(inputs: dict[str, np.ndarray]) -> dict:
    if "sampling_parameters" not in inputs:
        return {}
    values = inputs["sampling_parameters"].reshape(-1)
    if values.size != 1:
        raise ValueError(f"'sampling_parameters' must hold one JSON string; got {values.size} elements")
    raw = _string(values[0], "sampling_parameters")
    try:
        given = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"'sampling_parameters' is not valid JSON: {err}") from None
    if not isinstance(given, dict):
        raise ValueError(f"'sampling_parameters' must be a JSON object; got {type(given).__name__}")
    unknown = sorted(set(given) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in 'sampling_parameters'; supported: {', '.join(SAMPLING_KEYS)}")
    return {k: _convert(k, v, "sampling_parameters") for k, v in given.items() if v is not None}


def _scalar_inputs(inputs: dict[str, np.ndarray]) -> dict:
    out = {}
    for name, field in SAMPLING_INPUTS.items():
        if name not in inputs:
            continue
        values = inputs[name].reshape(-1)
        if name == "stop_words":
            out[field] = [_string(v, name) for v in values]
            continue
        if values.size != 1:
            raise ValueError(f"'{name}' must hold one value; got {values.size}")
        if field in out:  # min_tokens and min_length both
            raise ValueError(f"'{name}' and 'min_tokens' set the same thing: send one of them")
        value = values[0]
        out[field] = bool(value) if name == "ignore_eos" else value.item()
    return out


def _convert(key: str, value, where: str):
    """A JSON or parameter value as the SamplingParams field wants it (numbers may be strings)."""
    kind = SAMPLING_KEYS[key]
    if kind is list:
        if key == "stop" and isinstance(value, str):
            return [value]
        if not isinstance(value, list):
            raise ValueError(f"'{key}' in {where} must be a list; got {json.dumps(value)}")
        return value
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ValueError(f"'{key}' in {where} must be true or false; got {json.dumps(value)}")
        return value
    if isinstance(value, bool):
        raise ValueError(f"'{key}' in {where} must be a number; got {json.dumps(value)}")
    if isinstance(value, str):
        try:
            value = float(value) if kind is float else int(value)
        except ValueError:
            raise ValueError(f"'{key}' in {where} must be a number; got {json.dumps(value)}") from None
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


def _params(settings: dict) -> SamplingParams:
    if settings.get("top_k") == -1:
        settings["top_k"] = 0  # vLLM's "off" is -1, ours 0
    for key in ("stop", "stop_token_ids"):
        if key in settings:
            settings[key] = tuple(settings[key])
    try:
        return SamplingParams(**settings)  # its ValueError names the field and the allowed range
    except FieldError as err:
        if err.field == "n":  # the one field whose input has another name
            raise FieldError("n", f"'num_return_sequences': {err}") from None
        raise


def _encode(text: str, tokenizer) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot take 'text_input'")
    return encode_text(tokenizer, text)  # as LLM.generate and the OpenAI server encode it


def _bool(inputs: dict[str, np.ndarray], name: str, default: bool) -> bool:
    if name not in inputs:
        return default
    values = inputs[name].reshape(-1)
    if values.size != 1:
        raise ValueError(f"'{name}' must hold one boolean; got {values.size} values")
    if values.dtype != np.bool_:  # Triton checks the declared type; this guards any other caller
        raise ValueError(f"'{name}' must be a boolean (BOOL); got {values.dtype}")
    return bool(values[0])


def _string(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"'{name}' is not valid UTF-8: {err}") from None
    if isinstance(value, str):
        return value
    raise ValueError(f"'{name}' must be a string; got {type(value).__name__}")
