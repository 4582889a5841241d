"""The target loop with the real DraftWorker in this process (`LLM(launch="local")`, no MPI):
joins and leaves, stops, release bookkeeping, metrics, the rows verified, seeds, logprobs. Load
control's tests are in test_load_control.py, a lost draft's in test_draft_client.py."""

from __future__ import annotations

import math
import time

import pytest
import torch

from local_llm import PROMPTS, Alternate, ar_outputs, local_llm
from trtssd import SamplingParams
from trtssd.backends.base import chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.config import Source
from trtssd.sampling import processed_logprobs, processed_probs
from trtssd.spec_decode.saguaro import saguaro_probs


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_joins_and_leaves_keep_greedy_output_and_release_everything(tiny_pair, mode):
    """Six requests of different lengths through two rows: requests wait, join as others leave
    (between rounds), and every output equals plain greedy decoding."""
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (5, 40, 17, 3, 29, 11)]
    ref = [ar_outputs(tiny_pair, [p], sp)[0] for p, sp in zip(PROMPTS, params)]
    with local_llm(tiny_pair, mode, max_batch=2) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        worker = llm.loop.draft.server.worker
        summary = llm.metrics.summary()
        # Finished sequences are released on both sides (the draft's once the next message goes).
        assert not llm.loop.scheduler.running and not llm.loop.scheduler.waiting
        assert len(worker.seqs) <= 2 and not (set(worker.cache) - set(worker.seqs))
    assert got == ref
    assert summary["degraded_rounds"] == 0


def test_every_first_round_is_speculated_during_prefill(tiny_pair):
    """With the draft idle while the target prefills (as LocalDraft always is), each request's
    first round is answered from the tree of its first token. A draft that is the target guesses
    the greedy first token with one branch, so no first round of a batch of 3 misses (before,
    every one did), and the output is still plain greedy."""
    params = SamplingParams(temperature=0, max_tokens=2)  # the first token, then one round
    ref = ar_outputs(tiny_pair, PROMPTS[:3], params)
    with local_llm(tiny_pair, "ssd", draft=tiny_pair[0], max_batch=3, fanout=(1, 0, 0, 0, 0), k=4) as llm:
        outs = llm.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in outs] == ref
    assert [(o.metrics["cache_hits"], o.metrics["cache_misses"]) for o in outs] == [(1, 0)] * 3


def test_the_draft_forgets_finished_sequences(tiny_pair):
    with local_llm(tiny_pair, "ssd", max_batch=3) as llm:
        worker = llm.loop.draft.server.worker
        llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6))
        llm.generate(PROMPTS[3:4], SamplingParams(temperature=0, max_tokens=6))
        # The second batch's first message released the first batch's rows on the draft.
        assert set(worker.seqs) <= {3}
        assert set(worker.cache) <= {3}


def test_stops_inside_a_round(tiny_pair):
    greedy = SamplingParams(temperature=0, max_tokens=30)
    ref = ar_outputs(tiny_pair, [PROMPTS[0]], greedy)[0]
    stop = ref[10]
    cut = ref.index(stop) + 1
    with local_llm(tiny_pair, "ssd") as llm:
        out = llm.generate([PROMPTS[0]] * 2, [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]),
                                              SamplingParams(temperature=0, max_tokens=7)])
    assert out[0].token_ids == ref[:cut] and out[0].finish_reason == "stop"
    assert out[1].token_ids == ref[:7] and out[1].finish_reason == "length"


def test_metrics_count_only_emitted_tokens_and_each_round_once(tiny_pair):
    """The draft equals the target, so every round accepts all K: a max_tokens that is not a
    multiple of K+1 cuts accepted tokens in the last round, and they must not be counted."""
    target, _ = tiny_pair
    k = 4
    params = SamplingParams(temperature=0, max_tokens=13)
    with local_llm(tiny_pair, "ssd", draft=target, k=k, max_batch=4) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(PROMPTS[:4], params)
        wall = time.perf_counter() - t0
        total = llm.metrics
    for o in outs:
        m = o.metrics
        # token 1 comes from the prefill; each round emits its accepted tokens and, unless cut, its bonus
        assert m["num_accepted_tokens"] + m["num_drafts"] - 1 <= len(o.token_ids) - 1 <= m["num_accepted_tokens"] + m["num_drafts"]
        assert sum(m["accepted_per_position"]) == m["num_accepted_tokens"]
    assert total.num_accepted_tokens == sum(o.metrics["num_accepted_tokens"] for o in outs)
    # Aggregate round times add each batched round once, not once per request in it.
    assert total.round_time_s <= wall
    assert total.verify_time_s <= total.round_time_s


def test_sd_rounds_are_neither_hits_nor_misses(tiny_pair):
    with local_llm(tiny_pair, "sd") as llm:
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, max_tokens=20))
        s = llm.metrics.summary()
    assert s["num_drafts"] > 0
    assert s["cache_hits"] == s["cache_misses"] == s["neural_backups"] == s["fast_backups"] == 0


def _capture_rounds(llm) -> list:
    """Record every (request, tokens, q rows) the target verifies."""
    draft = llm.loop.draft
    seen = []
    original = draft.speculate

    def spy(req):
        reply, tokens, probs = original(req)
        seen.append((req, reply, tokens.clone(), None if probs is None else probs.clone()))
        return reply, tokens, probs

    draft.speculate = spy
    return seen


FANOUT = (2, 2, 2, 2, 2, 3)  # K = 5, every depth cached: Saguaro scales every unseeded ssd row


@pytest.mark.parametrize("mode,seed,skewed", [("sd", None, False), ("sd", 3, False), ("ssd", 3, False),
                                              ("ssd", None, True)])
def test_verified_rows_are_the_rows_the_draft_sampled_from(tiny_pair, mode, seed, skewed):
    """The q rows the target verifies, recomputed from the draft model over the same tokens: sd
    drafts from the draft's own processed q (no Saguaro skew: it has no cache), and so do seeded
    ssd rows; unseeded ssd rows from Saguaro's q' with the depth's fan-out. Every proposed token
    has mass under its row."""
    draft_dir, _ = tiny_pair  # the target drafts for itself: high acceptance, many hits
    c = 0.5
    params = SamplingParams(temperature=0.6, top_k=20, seed=seed, max_tokens=60)
    with local_llm(tiny_pair, mode, draft=draft_dir, saguaro_c=c, fanout=FANOUT, backup="neural") as llm:
        rounds = _capture_rounds(llm)
        out = llm.generate([PROMPTS[0]], params)[0]
    ref = TorchExecutor.from_pretrained(draft_dir, max_seqs=1, max_seq_len=256)
    history = PROMPTS[0] + out.token_ids
    emitted = 1  # the prefill's token
    for r, (req, reply, tokens, probs) in enumerate(rounds):
        if r > 0:
            emitted += req.outcomes[0].num_accepted + 1
        start = len(PROMPTS[0]) + emitted  # committed tokens, the bonus last
        assert history[start - 1] == req.outcomes[0].bonus
        ref.add_sequence(0)
        logits = ref.forward([chain_chunk(0, history[:start] + tokens[0].tolist(), 0)])[0]
        ref.release(0)
        q = processed_probs(logits[start - 1:start - 1 + tokens.shape[1]][None], [params])[0]
        want = saguaro_probs(q, torch.tensor(FANOUT[:-1]), c) if skewed else q
        assert torch.allclose(probs[0], want, atol=1e-5), (r, reply.sources, (probs[0] - want).abs().max())
        assert bool((probs[0].gather(-1, tokens[0][:, None]) > 0).all())
        if skewed:
            assert not torch.allclose(probs[0], q, atol=1e-3)  # the two cases are told apart
    assert len(rounds) >= 4
    if mode == "ssd":
        assert any(reply.sources[0] is Source.HIT for _, reply, _, _ in rounds)  # hit rows checked too

# --- seeds ---------------------------------------------------------------------------------

SAMPLED = dict(temperature=0.8, top_p=0.95, max_tokens=40)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_the_largest_seed_works(tiny_pair, mode):
    with local_llm(tiny_pair, mode) as llm:
        out = llm.generate([PROMPTS[0]], SamplingParams(seed=2**63 - 1, **SAMPLED))[0]
        assert llm.draft_state == "alive" and llm.metrics.degraded_rounds == 0
    assert len(out.token_ids) == SAMPLED["max_tokens"]


def test_a_seeded_request_gives_one_output_alone_in_a_batch_and_in_sd_or_ssd(tiny_pair):
    """What a seed promises (README): with the same engine and K, a seeded request's output does
    not depend on the batch, on timing (auto fan-out and backup), on cache hits, or on sd vs ssd."""
    seeded = SamplingParams(seed=1234, **SAMPLED)
    others = [SamplingParams(seed=s, **SAMPLED) for s in range(3)] + [SamplingParams(**SAMPLED)] * 3 + \
        [SamplingParams(temperature=0, max_tokens=40)]
    outputs = []
    for mode, fanout in (("ssd", "auto"), ("ssd", (3, 1, 1, 1, 1, 4)), ("sd", "auto")):
        with local_llm(tiny_pair, mode, fanout=fanout, max_batch=8) as llm:
            alone = llm.generate([PROMPTS[0]], seeded)[0].token_ids
            again = llm.generate([PROMPTS[0]], seeded)[0].token_ids
            batch = llm.generate([PROMPTS[0]] + PROMPTS[1:] + PROMPTS[:2], [seeded] + others)
            summary = llm.metrics.summary()
        assert alone == again == batch[0].token_ids, mode
        outputs.append(alone)
        if mode == "ssd":
            assert summary["cache_hits"] > 0 and summary["cache_misses"] > 0  # both paths took part
    assert outputs[0] == outputs[1] == outputs[2]


def test_consecutive_seeds_are_independent(tiny_pair):
    """The draft's stream must not be another request's target stream (it was seed + 1): in sd,
    P(token 2 of request s == token 1 of request s + 1) must be what independence gives."""
    target, draft = tiny_pair
    n = 1500
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=s) for s in range(n + 1)]
    with local_llm(tiny_pair, "sd", k=1, max_batch=32) as llm:
        tokens = [o.token_ids for o in llm.generate([PROMPTS[4]] * (n + 1), params)]
    first = torch.tensor([t[0] for t in tokens])
    second = torch.tensor([t[1] for t in tokens])
    same = (second[:-1] == first[1:]).double().mean().item()
    # Independence: sum_v P(token 2 = v) P(token 1 = v), from the empirical marginals.
    p1 = torch.bincount(first, minlength=64).double() / len(first)
    p2 = torch.bincount(second, minlength=64).double() / len(second)
    expected = float((p1 * p2).sum())
    sigma = (expected * (1 - expected) / n) ** 0.5
    assert abs(same - expected) < 4.5 * sigma + 0.005, (same, expected)


# --- logprobs ----------------------------------------------------------------------------------


def _offline_logprobs(tiny_pair, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's processed log-distribution at each output position, from one plain forward of
    the whole text on a fresh executor."""
    target, _ = tiny_pair
    ex = TorchExecutor.from_pretrained(str(target), max_seqs=1, max_seq_len=256)
    ex.add_sequence(0)
    logits = ex.forward([chain_chunk(0, prompt + output[:-1], 0)])[0][len(prompt) - 1:]
    return processed_logprobs(logits[None], [params])[0]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "ssd-with-plain-rounds"])
def test_logprobs_are_the_targets_processed_distribution_on_every_path(tiny_pair, mode):
    """Each emitted token's logprob and its alternatives, greedy and sampled, are those of the
    target's own distribution at that position (prefill's first token, plain rounds, accepted
    drafts and bonus tokens alike); a request that does not ask gets none."""
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=3),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=24, logprobs=5),
              SamplingParams(temperature=0, max_tokens=24)]
    plain_rounds = mode == "ssd-with-plain-rounds"
    with local_llm(tiny_pair, mode.split("-")[0], max_batch=3, plain_under_load=plain_rounds) as llm:
        if plain_rounds:
            llm.loop.policy.chooser = Alternate()
        outs = llm.generate(PROMPTS[:3], params)
    assert outs[2].logprobs is None
    if mode != "ar":
        assert sum(o.metrics["num_drafts"] for o in outs) > 0
    for prompt, p, out in zip(PROMPTS, params, outs[:2]):
        want = _offline_logprobs(tiny_pair, prompt, out.token_ids, p)
        assert [e.token_id for e in out.logprobs] == out.token_ids
        for i, e in enumerate(out.logprobs):
            assert abs(e.logprob - float(want[i, e.token_id])) < 1e-5, (i, e)
            values, ids = want[i].topk(p.logprobs)
            expected = [(t, v) for t, v in zip(ids.tolist(), values.tolist()) if v != -math.inf]
            assert [t for t, _ in e.top] == [t for t, _ in expected]
            assert all(abs(v - w) < 1e-5 for (_, v), (_, w) in zip(e.top, expected))

