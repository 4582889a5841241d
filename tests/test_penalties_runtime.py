"""Penalties, logit_bias, bad words and min_tokens through the runtime (`LLM`, the real draft worker
in this process): greedy output equals plain greedy decoding with the same settings (``ar``) in sd
and ssd on every path (hits, both backups, plain rounds), on the torch
and the ggml executors, bit for bit; min_tokens keeps a model going past the stop token it emits
early; a seeded sampled request gives one output twice and in sd and ssd; bans that would leave
no token ban nothing there; token ids outside the vocabulary are refused at admission, naming the
field."""

from __future__ import annotations

from pathlib import Path

import pytest

from local_llm import Alternate
from tiny_models import make_tiny_pair
from trtssd import LLM, ModelRef, SamplingParams
from trtssd.sampling import FieldError

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12, [3, 1, 4, 1, 5, 9, 2, 6], [42, 17], [5, 6] * 5]
LENGTH = 24
PATHS = {
    "sd": ("sd", {}, None),
    "ssd-neural": ("ssd", {"backup": "neural"}, None),
    "ssd-fast": ("ssd", {"backup": "fast"}, None),
    "ssd-with-plain-rounds": ("ssd", {"plain_under_load": True}, (True, False, False)),
}


@pytest.fixture(scope="module")
def torch_pair(tmp_path_factory) -> tuple[ModelRef, ModelRef]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("penalties"))
    return ModelRef(str(target)), ModelRef(str(draft))


@pytest.fixture(scope="module")
def ggml_pair(tmp_path_factory) -> tuple[ModelRef, ModelRef]:
    pytest.importorskip("llama_cpp")
    from ggml_models import write_tiny_gguf

    root = tmp_path_factory.mktemp("penalties-gguf")
    target = write_tiny_gguf(root / "target.gguf", tensor_type="q8_0", scale=0.3)
    draft = write_tiny_gguf(root / "draft.gguf", tensor_type="q8_0", scale=0.3, noise=0.02)
    return ModelRef(str(target), backend="ggml"), ModelRef(str(draft), backend="ggml")


def _generate(pair, mode: str, prompts, params, pattern=None, **options) -> tuple[list[list[int]], dict]:
    target, draft = pair
    options = {"k": 3, "max_batch": len(prompts), "max_model_len": 128, "plain_under_load": False, **options}
    with LLM(target=target, draft=draft, mode=mode, launch="local", **options) as llm:
        if pattern is not None:
            llm.loop.policy.chooser = Alternate(pattern)
        outs = llm.generate(prompts, params)
        assert llm.metrics.degraded_rounds == 0
        return [o.token_ids for o in outs], llm.metrics.summary()


def _adjusted_params(plain: list[list[int]], vocab: int) -> list[SamplingParams]:
    """One request per prompt, each adjusting its greedy output: chosen from the plain greedy
    outputs so that every setting has something to change."""
    greedy = dict(temperature=0, max_tokens=LENGTH, ignore_eos=True)
    first, pair = plain[2][0], plain[4][3:5]
    return [
        # Positive penalties change a repetitive output; a negative frequency penalty any other.
        SamplingParams(frequency_penalty=-1.5, presence_penalty=0.5, **greedy),
        SamplingParams(repetition_penalty=1.5, **greedy),
        SamplingParams(logit_bias={first: -100, (first + 1) % vocab: 2.5}, **greedy),
        SamplingParams(bad_words_ids=[pair, [plain[3][1]]], **greedy),
        # The output's first token becomes a stop token: plainly it ends at once.
        SamplingParams(min_tokens=LENGTH - 4, stop_token_ids=[plain[4][0]], temperature=0, max_tokens=LENGTH),
        SamplingParams(frequency_penalty=-0.5, presence_penalty=1.0, repetition_penalty=1.2, logit_bias={first: 1.0},
                       bad_words_ids=[pair], min_tokens=6, stop_token_ids=[plain[5][0]], temperature=0,
                       max_tokens=LENGTH),
    ]


def _check_every_path(pair, vocab: int) -> None:
    plain, _ = _generate(pair, "ar", PROMPTS, SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True))
    params = _adjusted_params(plain, vocab)
    reference, _ = _generate(pair, "ar", PROMPTS, params)
    # Every setting changed the output it was chosen to change, as its definition says.
    assert all(ref != out for ref, out in zip(reference, plain))
    assert plain[4][0] not in reference[4][:LENGTH - 4] and len(reference[4]) >= LENGTH - 4
    stopped, _ = _generate(pair, "ar", PROMPTS[4:5], SamplingParams(temperature=0, max_tokens=LENGTH,
                                                                   stop_token_ids=[plain[4][0]]))
    assert stopped == [plain[4][:1]]
    word = tuple(params[3].bad_words_ids[0])
    assert all(tuple(reference[3][i:i + 2]) != word for i in range(len(reference[3]))) and plain[3][1] not in reference[3]
    assert reference[2][0] != plain[2][0]
    for name, (mode, options, pattern) in PATHS.items():
        got, summary = _generate(pair, mode, PROMPTS, params, pattern, **options)
        assert got == reference, name
        assert summary["num_drafts"] > 0, name
        if name == "ssd-neural":
            assert summary["cache_hits"] > 0 and summary["neural_backups"] > 0
        if name == "ssd-fast":
            assert summary["fast_backups"] > 0
    # A lone row in plain rounds outside ar mode (where a ggml target may verify an n-gram guess).
    alone, _ = _generate(pair, "ssd", PROMPTS[5:6], params[5], pattern=(False,), plain_under_load=True)
    assert alone == reference[5:6]


def test_greedy_with_every_adjustment_equals_ar_on_every_path_on_torch(torch_pair):
    _check_every_path(torch_pair, 64)


def test_greedy_with_every_adjustment_equals_ar_on_every_path_on_ggml(ggml_pair):
    _check_every_path(ggml_pair, 512)


def test_a_seeded_sampled_request_with_penalties_repeats_in_sd_and_ssd(torch_pair):
    seeded = SamplingParams(temperature=0.9, seed=77, frequency_penalty=0.7, presence_penalty=0.3,
                            repetition_penalty=1.3, logit_bias={5: 2.0}, min_tokens=5, stop_token_ids=[9],
                            max_tokens=30)
    others = [SamplingParams(temperature=0.8, max_tokens=30), SamplingParams(temperature=0, max_tokens=30)]
    outputs = []
    for mode in ("ssd", "sd"):
        alone, _ = _generate(torch_pair, mode, PROMPTS[:1], seeded)
        again, _ = _generate(torch_pair, mode, PROMPTS[:3], [seeded] + others)
        assert alone[0] == again[0], mode
        outputs.append(alone[0])
    assert outputs[0] == outputs[1]


def test_bans_that_cover_every_token_ban_nothing_there_on_every_path(torch_pair):
    """Words [a, t] for every token t ban everything after an a: there they ban nothing (before:
    greedy took token 0 from all -inf logits and sampling a NaN distribution), so greedy output
    is plain greedy decoding in ar, sd and ssd; a request whose every token is a stop token
    under min_tokens ends at its first, sampled or not."""
    plain, _ = _generate(torch_pair, "ar", PROMPTS, SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True,
                             bad_words_ids=[[out[3], t] for t in range(64)]) for out in plain]
    for mode, options, pattern in [("ar", {}, None), *PATHS.values()]:
        got, _ = _generate(torch_pair, mode, PROMPTS, params, pattern, **options)
        assert got == plain, mode
    every = [SamplingParams(temperature=t, seed=3, max_tokens=8, min_tokens=4, stop_token_ids=list(range(64)))
             for t in (0, 1.0)]
    for mode in ("ar", "ssd"):
        outs, _ = _generate(torch_pair, mode, PROMPTS[:2], every)
        assert [len(o) for o in outs] == [1, 1], mode


def test_token_ids_outside_the_vocabulary_are_refused_at_admission(torch_pair):
    target, draft = torch_pair
    with LLM(target=target, draft=draft, mode="ar", launch="local", max_model_len=64) as llm:
        for params, field in ((SamplingParams(logit_bias={64: 1.0}), "logit_bias"),
                              (SamplingParams(bad_words_ids=[[3, 70]]), "bad_words_ids"),
                              (SamplingParams(stop_token_ids=[64], min_tokens=1), "stop_token_ids")):
            with pytest.raises(FieldError, match=r"\[0, 64\)") as err:
                llm.generate([PROMPTS[0]], params)
            assert err.value.field == field
        assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, logit_bias={63: 1.0}))[0].token_ids
