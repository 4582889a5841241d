"""Penalties and token biases on the Triton model, by TensorRT-LLM's input names (presence_penalty,
frequency_penalty, repetition_penalty, min_tokens or min_length, bad_words, embedding_bias,
embedding_bias_words with embedding_bias_weights) and vLLM's sampling_parameters keys: parsed
into SamplingParams, bad values refused by name; then on a real tritonserver (the SmolLM2 ggml
engine in ar mode) a bad word and an embedding bias move greedy output off the token it would
pick, the penalties change a repetitive answer, and a bias outside the vocabulary is an error."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from test_penalties_serving import ar_answers, engine  # noqa: F401 - a fixture
from test_structured_triton import server  # noqa: F401 - the same server: the ggml engine in ar mode
from test_triton import FakeTokenizer, _inputs, _joined, grpc_stream, server_test
from trtssd import SamplingParams
from trtssd.models.tokenizer import load_tokenizer
from trtssd.triton.repository import config_pbtxt
from trtssd.triton.triton_requests import parse_request


def _params(**values) -> SamplingParams:
    return parse_request(_inputs(text_input="hi", **values), {}, FakeTokenizer()).params


def test_tensorrt_llm_inputs_set_the_sampling_fields():
    sp = _params(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.5, min_tokens=3, max_tokens=10,
                 bad_words=["ab", "c", ""], embedding_bias_words=["x", "yz"], embedding_bias_weights=[2.0, -1.5])
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_tokens) == (0.5, -0.25, 1.5, 3)
    # FakeTokenizer: a character's code point is its token id; an empty word bans nothing.
    assert sp.bad_words_ids == ((97, 98), (99,))
    assert dict(sp.logit_bias) == {120: 2.0, 121: -1.5, 122: -1.5}
    assert _params(min_length=4).min_tokens == 4
    dense = np.zeros(200, dtype=np.float32)
    dense[[7, 120]] = [-100.0, 1.0]
    sp = _params(embedding_bias=list(dense), embedding_bias_words=["x"], embedding_bias_weights=[0.5])
    assert dict(sp.logit_bias) == {7: -100.0, 120: 1.5}
    assert not _params(embedding_bias=[0.0] * 5).adjusts_logits


def test_vllm_sampling_parameters_keys_set_them_too():
    sp = parse_request(_inputs(text_input="hi", sampling_parameters='{"presence_penalty": "1", "min_tokens": 2, '
                                                                    '"frequency_penalty": 0.5, "repetition_penalty": 1.2}'),
                       {}, FakeTokenizer()).params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_tokens) == (1.0, 0.5, 1.2, 2)


@pytest.mark.parametrize("values, match", [
    ({"presence_penalty": 2.5}, r"SamplingParams.presence_penalty must be a number in [-2, 2]"),
    ({"repetition_penalty": 0.0}, r"SamplingParams.repetition_penalty must be a number in [0.01, 100]"),
    ({"min_tokens": 20, "max_tokens": 10}, r"SamplingParams.min_tokens must be an int in [0, max_tokens = 10]"),
    ({"min_tokens": 2, "min_length": 2}, "'min_length' and 'min_tokens' set the same thing"),
    ({"embedding_bias": [0.0, -np.inf]}, "'embedding_bias' values (with the embedding_bias_words weights) must be finite"),
    ({"embedding_bias": [0.0, 150.0]}, "in [-100, 100]"),
    ({"embedding_bias_words": ["a", "b"], "embedding_bias_weights": [1.0]}, "one weight per 'embedding_bias_words'"),
    ({"embedding_bias_words": ["a"]}, "one weight per 'embedding_bias_words'"),
])
def test_bad_values_are_refused_by_name(values, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        _params(**values)


def test_submit_errors_name_the_input_the_client_sent():
    """The loop's checks at submit name SamplingParams' fields: a client of the Triton model reads
    the input it sent (a bias outside the vocabulary can only come from embedding_bias)."""
    from trtssd.sampling import FieldError
    from trtssd.triton.backend import _named

    assert _named(FieldError("logit_bias", "ids past 49152")) == "'embedding_bias': ids past 49152"
    assert _named(FieldError("n", "n above max_batch")) == "'num_return_sequences': n above max_batch"
    assert _named(FieldError("max_tokens", "too long")) == "too long"


def test_words_need_a_tokenizer():
    with pytest.raises(ValueError, match="no tokenizer, so it cannot take 'bad_words'"):
        parse_request(_inputs(text_input="hi", bad_words=["a"]), {}, None)


def test_config_lists_the_inputs():
    text = config_pbtxt()
    for name, kind, dims in (("presence_penalty", "TYPE_FP32", "1"), ("frequency_penalty", "TYPE_FP32", "1"),
                             ("repetition_penalty", "TYPE_FP32", "1"), ("min_tokens", "TYPE_INT32", "1"),
                             ("min_length", "TYPE_INT32", "1"), ("bad_words", "TYPE_STRING", "-1"),
                             ("embedding_bias", "TYPE_FP32", "-1"), ("embedding_bias_words", "TYPE_STRING", "-1"),
                             ("embedding_bias_weights", "TYPE_FP32", "-1")):
        assert re.search(rf'name: "{name}" data_type: {kind} dims: \[ {dims} \] optional: true', text), name


# --- a real server ---------------------------------------------------------------------------------

PROMPT = "1, 2, 1, 2, 1, 2, 1, 2,"
LENGTH = 8
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def reference(engine):
    """ar's greedy answers, plain and penalised; the text of the plain answer's first token."""
    answers, vocab = ar_answers(engine, PROMPT, LENGTH, {"penalised": PENALTIES})
    tokenizer = load_tokenizer(engine)
    first_text = tokenizer.decode(answers["plain"][:1])
    assert tokenizer.encode(first_text, add_special_tokens=False) == answers["plain"][:1]
    return SimpleNamespace(plain=answers["plain"], penalised=answers["penalised"], first_text=first_text, vocab=vocab)


def _greedy(server, **values) -> list[int]:
    return _joined(grpc_stream(server, text_input=PROMPT, temperature=0.0, max_tokens=LENGTH, **values))[1]


@server_test
def test_bad_words_embedding_bias_and_penalties_change_greedy_output(server, reference):
    assert _greedy(server) == reference.plain
    banned = _greedy(server, bad_words=[reference.first_text])
    assert banned[0] != reference.plain[0] and reference.plain[0] not in banned
    bias = np.zeros(reference.vocab, dtype=np.float32)
    bias[reference.plain[0]] = -100.0
    assert _greedy(server, embedding_bias=bias)[0] != reference.plain[0]
    penalised = _greedy(server, **{name: np.float32(value) for name, value in PENALTIES.items()})
    assert penalised == reference.penalised != reference.plain


@server_test
def test_a_bias_outside_the_vocabulary_is_an_error_and_the_server_stays_ready(server, reference):
    bias = np.zeros(reference.vocab + 3, dtype=np.float32)
    bias[-1] = 1.0
    responses = grpc_stream(server, text_input=PROMPT, max_tokens=2, embedding_bias=bias)
    assert "'embedding_bias': SamplingParams.logit_bias token ids must be in [0," in str(responses[-1])
    assert len(_greedy(server)) == LENGTH
