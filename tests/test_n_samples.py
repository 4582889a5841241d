"""``SamplingParams.n``: a request's samples share one prefill (sample 0 prefills the prompt, the
others take its KV on the target and on the draft), each sample is exact (greedy equals the single
request, bit for bit on ggml; a seeded sample j is the request seeded `sample_seed(seed, j)`),
unseeded samples are independent draws, aborts end every sample, and bad values are refused
naming ``n``. On torch (the tiny pair) and ggml (a tiny GGUF) executors, the draft in this process.
The servers' n (OpenAI choices, Triton's num_return_sequences) are tested in test_openai_server.py and
test_triton.py."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import pytest
import torch

from trtssd import LLM, ModelRef, SamplingParams
from trtssd.sampling import MAX_N, FieldError, sample_seed
from trtssd.serving.async_llm import AsyncLLM

VOCAB = 64  # the tiny pair's (tests/tiny_models.py)
PROMPT_LEN = 200


def _prompt(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


PROMPT = _prompt(PROMPT_LEN, 7)


# --- the parameter -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, MAX_N + 1, 2.0, True, "3", None])
def test_bad_n_is_a_field_error_naming_n(bad):
    with pytest.raises(FieldError) as err:
        SamplingParams(n=bad)
    assert err.value.field == "n" and f"[1, {MAX_N}]" in str(err.value)


@pytest.mark.parametrize("n, best_of, ok", [(None, 1, True), (1, 1, True), (3, None, True), (2, 1, False)])
def test_best_of_below_n_is_refused_naming_best_of(n, best_of, ok):
    """OpenAI's and vLLM's rule, best_of >= n: best_of 1 (the only value taken) with n > 1 is a
    400 naming best_of, not n samples silently."""
    from trtssd.serving.openai_requests import ApiError, CompletionRequest, ModelInfo

    body = CompletionRequest.model_validate({"prompt": [5, 6, 7], "n": n, "best_of": best_of})
    model = ModelInfo("m", None, 256)
    if ok:
        assert body.to_generation_request(model).params.n == (n or 1)
        return
    with pytest.raises(ApiError) as err:
        body.to_generation_request(model)
    assert (err.value.status, err.value.param) == (400, "best_of") and "at least 'n' (2)" in err.value.message


def test_sample_j_runs_as_a_request_of_its_own_seeded_by_seed_and_j():
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=5, n=4)
    samples = [params.for_sample(j) for j in range(4)]
    assert samples[0] == SamplingParams(temperature=0.7, seed=11, max_tokens=5)  # sample 0: the request without n
    assert [s.n for s in samples] == [1] * 4 and [s.seed for s in samples] == [sample_seed(11, j) for j in range(4)]
    seeds = [s.seed for s in samples]
    assert len(set(seeds)) == 4 and 12 not in seeds  # a hash of (seed, j): not the next request's seed
    assert all(0 <= s <= 2**63 - 1 for s in seeds) and sample_seed(11, 2) == seeds[2]  # a function of seed and j
    assert SamplingParams(n=3).for_sample(2).seed is None  # unseeded samples draw from torch's global RNG
    with pytest.raises(ValueError, match=r"sample index must be an int in \[0, 4\)"):
        params.for_sample(4)


def test_n_above_the_running_batch_is_refused_at_admission(tiny_llm):
    with tiny_llm(mode="ar", max_batch=4) as llm:
        with pytest.raises(FieldError) as err:
            llm.generate([PROMPT[:10]], SamplingParams(n=5))
        assert err.value.field == "n" and "n (5) exceeds max_batch 4" in str(err.value)
        with pytest.raises(FieldError, match="LLM.stream streams one sample"):
            next(llm.stream(PROMPT[:10], SamplingParams(n=2)))
        assert len(llm.generate([PROMPT[:10]], SamplingParams(n=4, max_tokens=2))[0].outputs) == 4


# --- one prefill -----------------------------------------------------------------------------------

class PromptTokens:
    """Counts the prompt tokens an executor prefills: the target's prompt chunks, the draft's
    prefill forwards (the only ones it asks for the last row's logits alone)."""

    def __init__(self, executor, draft: bool):
        self.tokens, self._forward, self._draft = 0, executor.forward, draft
        executor.forward = self

    def __call__(self, chunks):
        self.tokens += sum(c.tokens.numel() for c in chunks if (c.last_logits_only if self._draft else c.prompt))
        return self._forward(chunks)


def _count_prefills(llm: LLM) -> tuple[PromptTokens, PromptTokens]:
    return PromptTokens(llm.loop.target, draft=False), PromptTokens(llm.loop.draft.server.worker.executor, draft=True)


def _one_prefill(llm: LLM, n: int) -> None:
    target, draft = _count_prefills(llm)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, n=n))[0]
    assert [o.index for o in out.outputs] == list(range(n)) and all(len(o.token_ids) == 8 for o in out.outputs)
    assert (target.tokens, draft.tokens) == (PROMPT_LEN, PROMPT_LEN)  # not n times
    assert out.usage["prompt_tokens"] == PROMPT_LEN and out.usage["completion_tokens"] == 8 * n
    assert len(llm.loop.draft.server.worker.seqs) == 0  # every sample released on the draft too


@pytest.mark.parametrize("prefix_cache_seqs, prefill_chunk", [(0, 0), (8, 64)])
def test_torch_samples_share_one_prefill_on_both_ranks(tiny_llm, prefix_cache_seqs, prefill_chunk):
    with tiny_llm(mode="ssd", max_batch=4, k=3, plain_under_load=False, prefix_cache_seqs=prefix_cache_seqs,
                  prefill_chunk=prefill_chunk) as llm:
        _one_prefill(llm, 4)


def test_samples_the_draft_learns_of_late_take_the_prompt_there_too(tiny_llm):
    """Plain rounds first (load control's), then speculation: the draft is sent sample 0's prompt as
    the rows catch up, and the other samples take its KV there instead of prefilling it."""
    with tiny_llm(mode="ssd", max_batch=4, k=3, plain_under_load=False, prefix_cache_seqs=0) as llm:
        loop = llm.loop
        rounds = iter([False] * 3)
        loop.policy.speculate = lambda rows: next(rounds, True)
        loop.policy.draft_prefills_now = lambda batch: False
        _one_prefill(llm, 3)


@pytest.fixture(scope="module")
def ggml_pair(tmp_path_factory) -> ModelRef:
    pytest.importorskip("llama_cpp")
    from ggml_models import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensor_type="q8_0", scale=0.3,
                           vocab_size=VOCAB + 200)
    return ModelRef(str(gguf), backend="ggml")


def _ggml_llm(ref: ModelRef, mode: str, **options) -> LLM:
    return LLM(target=ref, draft=ref, mode=mode, launch="local", k=3, max_batch=4, max_model_len=320,
               plain_under_load=False, **options)


def test_ggml_samples_share_one_prefill_on_both_ranks(ggml_pair):
    with _ggml_llm(ggml_pair, "ssd", prefix_cache_seqs=0) as llm:
        _one_prefill(llm, 4)


# --- exactness -------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


def _same_as_single(llm: LLM, params: SamplingParams, n: int, tolerance: float) -> None:
    """Each of n greedy samples equals the request alone, its logprobs within ``tolerance``."""
    single = llm.generate([PROMPT], params)[0]
    many = llm.generate([PROMPT], dataclasses.replace(params, n=n))[0]
    for output in many.outputs:
        assert output.token_ids == single.token_ids
        assert [e.logprob for e in output.logprobs] == pytest.approx([e.logprob for e in single.logprobs],
                                                                     abs=tolerance, rel=0)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_torch_greedy_samples_equal_the_single_request(tiny_llm, mode):
    with tiny_llm(mode=mode, max_batch=4, k=3, plain_under_load=False, prefix_cache_seqs=0) as llm:
        _same_as_single(llm, GREEDY, 3, tolerance=1e-5)  # torch: a batch of 3 rounds fp32 unlike one row


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_ggml_greedy_samples_equal_the_single_request_bit_for_bit(ggml_pair, mode):
    with _ggml_llm(ggml_pair, mode, prefix_cache_seqs=0) as llm:
        _same_as_single(llm, GREEDY, 3, tolerance=0)  # row-invariant kernels: the same bits


SEEDED = SamplingParams(temperature=1.0, seed=2024, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_seeded_samples_repeat_and_sample_j_is_the_request_seeded_for_j(tiny_llm, mode):
    """The seed's promise holds per sample: the same n outputs twice, at any batch, and sample j is
    what a one-sample request seeded sample_seed(seed, j) gives (sample 0: the request without n)."""
    with tiny_llm(mode=mode, max_batch=4, k=3, plain_under_load=False) as llm:
        first = llm.generate([PROMPT], dataclasses.replace(SEEDED, n=3))[0]
        beside = llm.generate([PROMPT, PROMPT[:50]], [dataclasses.replace(SEEDED, n=3), SEEDED])[0]
        alone = [llm.generate([PROMPT], dataclasses.replace(SEEDED, seed=sample_seed(SEEDED.seed, j)))[0]
                 for j in range(3)]
    tokens = [o.token_ids for o in first.outputs]
    assert tokens == [o.token_ids for o in beside.outputs] == [a.token_ids for a in alone]
    assert len({tuple(t) for t in tokens}) == 3  # three draws, not one copied


def _first_token_counts(llm: LLM, requests: int, n: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """First tokens of ``requests`` unseeded requests of n samples at temperature 1 (top-k 20: the
    processed distribution fits the 20 logprobs each token reports), and that distribution."""
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=1, n=n, logprobs=20)
    draws = [[o.token_ids[0] for o in out.outputs] for out in llm.generate([PROMPT[:40]] * requests, params)]
    top = llm.generate([PROMPT[:40]], SamplingParams(temperature=1.0, top_k=20, max_tokens=1, logprobs=20))[0]
    p = torch.zeros(VOCAB, dtype=torch.float64)
    for token, logprob in top.logprobs[0].top:
        p[token] = math.exp(logprob)
    counts = torch.bincount(torch.tensor([t for d in draws for t in d]), minlength=VOCAB).double()
    return counts, p, draws


def _chi_square_p_value(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's test of counts against p, cells expecting fewer than 5 pooled into one."""
    expected = p / p.sum() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_unseeded_samples_are_independent_draws_of_the_processed_distribution(tiny_llm):
    """512 first tokens (8 requests x 64 samples) fit the target's processed distribution; the
    mutant whose samples copy their sample 0 (one draw per request, 64 times) is refused."""
    torch.manual_seed(0)
    with tiny_llm(mode="ar", max_batch=64, prefix_cache_seqs=0) as llm:
        counts, p, draws = _first_token_counts(llm, requests=8, n=64)
    assert _chi_square_p_value(counts, p) > 1e-4
    copies = torch.bincount(torch.tensor([d[0] for d in draws for _ in d]), minlength=VOCAB).double()
    assert _chi_square_p_value(copies, p) < 1e-4
    assert min(len(set(d)) for d in draws) > 5  # no request's samples are one token repeated


# --- aborts ----------------------------------------------------------------------------------------

def test_aborting_a_streamed_request_ends_every_sample_and_frees_their_rows(tiny_llm):
    with tiny_llm(mode="ssd", max_batch=4, k=3, plain_under_load=False, prefix_cache_seqs=0) as llm:
        served = AsyncLLM(llm).start()

        async def main():
            stream = served.submit(PROMPT[:30], SamplingParams(temperature=0.9, max_tokens=150, ignore_eos=True, n=3))
            indices = set()
            async for delta in stream:
                indices.add(delta.index)
                if len(indices) == 3:
                    stream.abort()
            return stream.final

        final = asyncio.run(main())
        served.shutdown()
        assert [o.finish_reason for o in final.outputs] == ["abort"] * 3
        assert all(0 < len(o.token_ids) < 150 for o in final.outputs)
        assert not llm.loop.has_unfinished() and not llm.loop.draft.server.worker.seqs
        assert not llm.loop.target._seqs  # every sample's target rows are free


def test_a_sample_0_aborted_before_its_prefill_hands_the_prompt_to_the_next(tiny_llm):
    """A sample ended before its prompt is prefilled (the loop's own abort of one sample): the
    samples waiting for its KV take the next one's, which prefills the prompt; they finish as
    requests seeded for their index would."""
    with tiny_llm(mode="ssd", max_batch=4, k=3, plain_under_load=False, prefix_cache_seqs=0,
                  prefill_chunk=32) as llm:
        loop = llm.loop
        params = dataclasses.replace(SEEDED, n=3)
        samples = loop.new_sequences(PROMPT, params)
        for seq in samples:
            loop.add(seq)
        loop.step()  # admitted together; sample 0's first piece prefilled
        assert loop.abort(samples[0].seq_id).finish_reason == "abort"
        while loop.has_unfinished():
            loop.step()
        alone = [llm.generate([PROMPT], dataclasses.replace(SEEDED, seed=sample_seed(SEEDED.seed, j)))[0]
                 for j in (1, 2)]
        assert [s.output for s in samples[1:]] == [a.token_ids for a in alone]
        assert samples[1].fork_of is None and samples[2].fork_of is samples[1]
        assert not loop.target._seqs and not loop.draft.server.worker.seqs
