"""The Python API against the real default engine (SmolLM2-135M target, int4 self-draft)."""

from __future__ import annotations

import pytest

from trtssd import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def llm():
    with LLM(mode="ssd", max_batch=4, max_model_len=256, plain_under_load=False) as instance:
        yield instance


def test_generate_is_list_in_list_out_with_metrics(llm):
    prompts = ["def add(a, b):", "The capital of France is", [504, 3458, 314]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        assert len(o.token_ids) == 16 and o.finish_reason == "length" and o.text
        assert o.metrics["num_drafts"] > 0 and o.metrics["ttft_s"] > 0
        assert {"mean_acceptance_length", "cache_hit_rate", "overlap_efficiency"} <= set(o.metrics)
    # Each prompt alone gives the same tokens as in the batch (greedy is exact either way).
    assert llm.generate(prompts[1], GREEDY)[0].token_ids == outs[1].token_ids


def test_per_request_parameters_and_stops(llm):
    outs = llm.generate(["Count: 1, 2, 3,", "Count: 1, 2, 3,"],
                        [SamplingParams(temperature=0, max_tokens=5),
                         SamplingParams(temperature=0, max_tokens=40, stop=(" 6",))])
    assert len(outs[0].token_ids) == 5 and outs[0].finish_reason == "length"
    assert outs[1].finish_reason == "stop" and " 6" not in outs[1].text


@pytest.mark.parametrize("per_token", [False, True])
def test_stream_deltas_join_to_the_generated_text(llm, per_token):
    params = SamplingParams(temperature=0, max_tokens=24)
    deltas = list(llm.stream("Write a haiku about the sea.", params, per_token=per_token))
    assert "".join(deltas) == llm.generate(["Write a haiku about the sea."], params)[0].text
    if per_token:
        assert len(deltas) >= 12  # one delta per token (up to merged partial characters), not per round


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert out.token_ids == llm.generate([list(ids)], SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        llm.chat([{"content": "no role"}])


@pytest.mark.parametrize("prompt, match", [
    ("", "non-empty"),
    ([], "non-empty"),
    ([1, "x"], "token ids"),
    ([10**9], r"prompt token ids must be in \[0, 49152\)"),
    ("word " * 400, "exceeds max_model_len"),
])
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["a good prompt first", prompt], GREEDY)
    assert not llm.loop.has_unfinished()  # all or nothing: the good prompt was not queued either
    assert len(llm.generate(["ok"], SamplingParams(temperature=0, max_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=-1), "max_tokens"),
])
def test_out_of_range_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_mismatched_parameter_list(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(colour="red"), TypeError, "unknown LLM option"),
    (dict(k=3, fanout=(1, 1)), ValueError, "fanout must be 'auto' or a list of k\\+1=4"),
    (dict(mode="fast"), ValueError, "mode must be one of 'ar', 'sd', 'ssd'"),
    (dict(max_batch=0), ValueError, "max_batch must be a positive integer"),
])
def test_bad_options_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(**kwargs)
