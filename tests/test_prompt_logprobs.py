"""Prompt logprobs (SamplingParams.prompt_logprobs) and prompt-only requests (max_tokens 0) in the
target loop: equal to an offline forward's processed log-distribution in every mode, in a batch
with other requests, without changing any output; a prompt-only request is never sampled, never
reaches the draft, and frees its rows."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tiny_models import make_tiny_pair
from trtssd import LLM, ModelRef, SamplingParams
from trtssd.backends.base import chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.sampling import FieldError, processed_logprobs

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12, [42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("prompt_logprobs"))


def _llm(tiny, mode: str, **kw) -> LLM:
    target, draft = tiny
    return LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode=mode, launch="local",
               max_model_len=256, plain_under_load=False, **kw)


def _offline(tiny, prompt: list[int], params: SamplingParams):
    """The processed log-distribution scoring each prompt token after the first, from one plain
    forward of the prompt on a fresh executor."""
    ex = TorchExecutor.from_pretrained(str(tiny[0]), max_seqs=1, max_seq_len=256)
    ex.add_sequence(0)
    logits = ex.forward([chain_chunk(0, prompt, 0)])[0][:-1]
    return processed_logprobs(logits[None], [params])[0]


def test_params_validate_prompt_logprobs_and_allow_max_tokens_zero():
    assert SamplingParams(max_tokens=0, prompt_logprobs=20).max_tokens == 0
    for bad in (-1, 21, True, 1.0):
        with pytest.raises(FieldError, match="prompt_logprobs") as err:
            SamplingParams(prompt_logprobs=bad)
        assert err.value.field == "prompt_logprobs"
    with pytest.raises(FieldError, match="max_tokens must be an int >= 0"):
        SamplingParams(max_tokens=-1)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_prompt_logprobs_match_offline_and_change_no_output(tiny, mode):
    params = [SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=3),
              SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, prompt_logprobs=0, logprobs=2),
              SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=12)]
    plain = [SamplingParams(temperature=p.temperature, top_k=p.top_k, seed=p.seed, max_tokens=p.max_tokens,
                            logprobs=p.logprobs) for p in params]
    with _llm(tiny, mode, max_batch=4) as llm:
        asked = llm.generate(PROMPTS, params)
        ref = llm.generate(PROMPTS, plain)
    assert [o.token_ids for o in asked] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in asked] == ["length"] * 4
    assert asked[2].token_ids == [] and asked[3].prompt_logprobs is None and ref[0].prompt_logprobs is None
    for prompt, p, out in zip(PROMPTS[:3], params, asked):
        want = _offline(tiny, prompt, p)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i, (tok, e) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:])):
            w = float(want[i, tok])  # -inf where top-k drops the prompt's token
            assert e.token_id == tok and (e.logprob == w or abs(e.logprob - w) < 1e-5)
            assert e.rank == int((want[i] > want[i, tok]).sum()) + 1
            values, ids = want[i].topk(p.prompt_logprobs) if p.prompt_logprobs else (want[i][:0], want[i][:0])
            assert [t for t, _ in e.top] == [t for t, v in zip(ids.tolist(), values.tolist()) if v != -math.inf]


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_max_tokens_zero_finishes_at_admission_and_frees_its_rows(tiny, mode, queue):
    with _llm(tiny, mode, max_batch=2) as llm:
        loop = llm.loop
        seq = queue(loop, [1, 2, 3, 4], SamplingParams(max_tokens=0))
        outs = loop.step()
        assert [(o.seq_id, o.new_token_ids, o.finished, o.finish_reason) for o in outs] == [(seq, [], True, "length")]
        assert outs[0].prompt_logprobs is None
        assert not loop.scheduler.running and not loop.scheduler.waiting and loop.pop_finished(seq).output == []
        with pytest.raises(Exception):
            loop.target.committed(seq)  # its target rows are gone
        if loop.draft is not None:
            assert seq not in loop.draft.server.worker.seqs  # the draft never held it
        # The loop goes on serving, a request at a time through both rows.
        out = llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=4))
        assert all(len(o.token_ids) == 4 for o in out)
