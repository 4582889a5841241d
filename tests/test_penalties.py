"""Penalties, logit_bias, bad words and min_tokens (SamplingParams): each field's validation, the
processing order against a plain loop over OpenAI's and Hugging Face's definitions, and the one
rule speculation rests on: position i of a chain is processed with the tokens before it."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
import torch

from test_sampling import reference_probs
from trtssd.sampling import (FieldError, History, SamplingParams, adjusted_logits, greedy_tokens,
                             processed_logprobs, processed_probs, prompt_logprobs, token_logprobs)
from trtssd.spec_decode.verify import verify

V = 12
EOS = 11


def reference_adjusted(logits: np.ndarray, sp: SamplingParams, prompt: list[int], before: list[int],
                       eos: tuple[int, ...] = (EOS,)) -> np.ndarray:
    """One position's logits after steps 2-6, float64, written from the definitions: ``before``
    is the output before the position."""
    x = logits.astype(np.float64).copy()
    for token, bias in sp.logit_bias:
        x[token] += bias
    text, allowed = prompt + before, x.copy()
    for word in sp.bad_words_ids:
        head = list(word[:-1])
        if not head or (len(text) >= len(head) and text[len(text) - len(head):] == head):
            x[word[-1]] = -math.inf
    if len(before) < sp.min_tokens:
        for token in set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos)):
            x[token] = -math.inf
    if np.isneginf(x).all():  # bad words and min_tokens ban nothing where they would ban every token
        x = allowed
    counts = Counter(before)
    for token in range(len(x)):
        if sp.repetition_penalty != 1 and (token in prompt or counts[token]):  # Hugging Face's
            x[token] = x[token] / sp.repetition_penalty if x[token] > 0 else x[token] * sp.repetition_penalty
        # OpenAI's: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        x[token] -= counts[token] * sp.frequency_penalty + (counts[token] > 0) * sp.presence_penalty
    return x


PENALISED = [
    SamplingParams(temperature=0.8, presence_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(temperature=1.0, repetition_penalty=1.6, top_k=6),
    SamplingParams(temperature=0.9, logit_bias={3: 5.0, 4: -100, 7: 0.5}, top_p=0.9),
    SamplingParams(temperature=1.2, bad_words_ids=[[5], [2, 6], [1, 2, 8]], min_p=0.05),
    SamplingParams(temperature=0.7, min_tokens=4, stop_token_ids=[9], max_tokens=10),
    SamplingParams(temperature=0, frequency_penalty=-1.5, repetition_penalty=0.7, logit_bias={0: 2.0}),
    SamplingParams(temperature=1.0, presence_penalty=2, frequency_penalty=2, repetition_penalty=2.5,
                   logit_bias={1: 1.0}, bad_words_ids=[[3, 3]], min_tokens=5, stop_token_ids=[4], max_tokens=8),
    SamplingParams(temperature=1.0, min_tokens=3, ignore_eos=True),
]


# ---- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.nan), ("presence_penalty", "1"),
    ("frequency_penalty", 3), ("frequency_penalty", math.inf), ("frequency_penalty", True),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", 0.0099), ("repetition_penalty", 1e-300), ("repetition_penalty", 100.5),
    ("logit_bias", {3: 100.5}), ("logit_bias", {3: -101}), ("logit_bias", {"3": 1.0}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {3: math.nan}), ("logit_bias", [(3, 1.0), (3, 2.0)]), ("logit_bias", 5),
    ("bad_words_ids", [[]]), ("bad_words_ids", [[-1]]), ("bad_words_ids", [1, 2]), ("bad_words_ids", [["a"]]),
    ("min_tokens", -1), ("min_tokens", 129), ("min_tokens", 1.0),
])
def test_bad_values_are_field_errors_naming_the_field(field, value):
    with pytest.raises(FieldError, match=rf"SamplingParams\.{field} must be") as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def test_limits_are_inclusive_and_forms_are_normalised():
    assert SamplingParams(repetition_penalty=100).repetition_penalty == 100
    sp = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01,
                        logit_bias={7: 100, 2: -100.0}, bad_words_ids=[[1, 2], [3]], min_tokens=128)
    assert sp.logit_bias == ((2, -100.0), (7, 100)) and sp.bad_words_ids == ((1, 2), (3,))
    assert sp == SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01,
                                logit_bias=[(7, 100), (2, -100.0)], bad_words_ids=((1, 2), (3,)), min_tokens=128)
    assert hash(sp) and sp.adjusts_logits and not SamplingParams().adjusts_logits


def test_min_tokens_cannot_come_with_a_constraint_and_ids_must_be_in_the_vocabulary():
    from trtssd.structured.constraint import Constraint

    with pytest.raises(FieldError) as err:
        SamplingParams(min_tokens=2, constraint=Constraint.regex("[a-z]+"))
    assert err.value.field == "min_tokens"
    assert SamplingParams(logit_bias={V - 1: 1.0}, bad_words_ids=[[0, V - 1]]).vocabulary_errors(V) is None
    for params, field in ((SamplingParams(logit_bias={V: 1.0}), "logit_bias"),
                          (SamplingParams(bad_words_ids=[[1, V + 3]]), "bad_words_ids"),
                          # min_tokens would index the logits with it
                          (SamplingParams(stop_token_ids=[2, V], min_tokens=1), "stop_token_ids")):
        err = params.vocabulary_errors(V)
        assert err.field == field and f"[0, {V})" in str(err)


# ---- the processing order -------------------------------------------------------------------------


def _history(rng: np.random.Generator) -> tuple[list[int], list[int], list[int]]:
    prompt = rng.integers(0, V, size=int(rng.integers(1, 6))).tolist()
    output = rng.integers(0, V, size=int(rng.integers(0, 7))).tolist()
    chain = rng.integers(0, V, size=4).tolist()
    return prompt, output, chain


@pytest.mark.parametrize("sp", PENALISED)
def test_every_position_of_a_chain_is_the_reference_with_the_tokens_before_it(sp):
    rng = np.random.default_rng(7)
    for trial in range(20):
        prompt, output, chain = _history(rng)
        logits = torch.from_numpy(rng.normal(0, 2, size=(1, len(chain) + 1, V)).astype(np.float32))
        history = History(prompt, output, (EOS,), chain)
        got = processed_probs(logits, [sp], [history])[0]
        adjusted = adjusted_logits(logits, [sp], [history])[0]
        for i in range(len(chain) + 1):
            before = output + chain[:i]
            want_x = reference_adjusted(logits[0, i].numpy(), sp, prompt, before)
            assert np.allclose(adjusted[i].numpy(), want_x, atol=1e-5), (trial, i)
            assert np.allclose(got[i].numpy(), reference_probs(want_x, sp), atol=1e-6), (trial, i)


@pytest.mark.parametrize("sp", PENALISED)
def test_a_chain_position_has_the_bits_of_a_plain_step_after_the_same_tokens(sp):
    """What makes greedy speculation equal plain greedy decoding: position i of a verify chain
    and a one-position call whose output holds the chain's first i tokens agree bit for bit."""
    rng = np.random.default_rng(11)
    prompt, output, chain = _history(rng)
    logits = torch.from_numpy(rng.normal(0, 2, size=(2, len(chain) + 1, V)).astype(np.float32))
    both = [sp, SamplingParams(temperature=0.5)]  # a neighbour row that adjusts nothing
    chained = processed_logprobs(logits, both, [History(prompt, output, (EOS,), chain), None])
    for i in range(len(chain) + 1):
        alone = processed_logprobs(logits[:1, i], [sp], [History(prompt, output + chain[:i], (EOS,))])[0]
        assert torch.equal(chained[0, i], alone), i
        step = greedy_tokens(logits[:1, i], [sp], [History(prompt, output + chain[:i], (EOS,))])
        assert int(step) == int(adjusted_logits(logits[:1, i:i + 1], [sp], [History(prompt, output + chain[:i],
                                                                                     (EOS,))])[0, 0].argmax())
    assert torch.equal(chained[1], processed_logprobs(logits[1:], both[1:])[0])


def test_min_tokens_masks_the_stop_tokens_until_the_output_is_long_enough():
    sp = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[4])
    logits = torch.zeros(1, 4, V)
    p = processed_probs(logits, [sp], [History([0], [1], (EOS,), [2, 3, 5])])[0]
    # Outputs of 1, 2 before positions 0, 1; 3 and 4 before positions 2, 3.
    assert (p[:2, [4, EOS]] == 0).all() and (p[2:, [4, EOS]] > 0).all()
    ignoring = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[4], ignore_eos=True)
    p = processed_probs(logits, [ignoring], [History([0], [], (EOS,), [2, 3, 5])])[0]
    assert (p[:3, 4] == 0).all() and (p[:, EOS] > 0).all()  # EOS stops nothing under ignore_eos


@pytest.mark.parametrize("sp, held", [
    # Every token a stop token under min_tokens: nothing banned before the 3rd output token either.
    (SamplingParams(temperature=0.9, min_tokens=3, stop_token_ids=list(range(V)), max_tokens=6), {}),
    (SamplingParams(temperature=0, min_tokens=3, stop_token_ids=list(range(V)), max_tokens=6), {}),
    # Every token completes a word after a 3 (positions 1 and 3): there the words ban nothing.
    (SamplingParams(temperature=1.0, bad_words_ids=[[3, t] for t in range(V)], repetition_penalty=0.01, top_k=4),
     {}),
    # Words ban the even tokens, min_tokens the odd ones until the output has 5: both hold at
    # position 4 only, where the odd ones are free again.
    (SamplingParams(temperature=0.7, bad_words_ids=[[t] for t in range(0, V, 2)], min_tokens=5,
                    stop_token_ids=list(range(1, V, 2)), logit_bias={4: -100}), {4: range(0, V, 2)}),
])
def test_a_position_whose_bans_cover_every_token_keeps_its_logits(sp, held):
    """Bad words and min_tokens that would ban every token the constraint leaves (here every
    token; the constraint's mask shows as a -inf logit) ban nothing at that position, so p there
    is a distribution (before: NaN, a sampled token drawn from no mass, NaN logprobs); where they
    leave a token they ban as always (``held``: position -> banned tokens), and a verify chain's
    position keeps a plain step's bits."""
    rng = np.random.default_rng(5)
    logits = torch.from_numpy(rng.normal(0, 2, size=(1, 5, V)).astype(np.float32))
    logits[0, :, 7] = -math.inf  # the constraint's mask on one token keeps it out either way
    prompt, output, chain = [1, 3], [2], [3, 5, 3, 0]
    history = History(prompt, output, (EOS,), chain)
    p = processed_probs(logits, [sp], [history])[0]
    assert torch.isfinite(p).all() and torch.allclose(p.sum(dim=-1), torch.ones(5)) and (p[:, 7] == 0).all()
    chained = processed_logprobs(logits, [sp], [history])[0]
    for i in range(5):
        want = reference_adjusted(logits[0, i].numpy(), sp, prompt, output + chain[:i])
        assert np.allclose(p[i].numpy(), reference_probs(want, sp), atol=1e-6), i
        alone = processed_logprobs(logits[:, i], [sp], [History(prompt, output + chain[:i], (EOS,))])[0]
        assert torch.equal(chained[i], alone), i
        assert set(np.flatnonzero(np.isneginf(want))) == {7, *held.get(i, ())}, i  # what the reference bans


def test_a_bad_word_is_banned_only_where_the_text_ends_with_its_other_tokens():
    sp = SamplingParams(temperature=1.0, bad_words_ids=[[6, 7, 8], [9]])
    logits = torch.zeros(1, 4, V)
    # The prompt ends with 6 and the output is empty: the word's first token comes from the prompt.
    p = processed_probs(logits, [sp], [History([1, 6], [], (), [7, 8, 6])])[0]
    assert p[1, 8] == 0 and p[0, 8] > 0 and p[2, 8] > 0 and p[3, 8] > 0
    assert (p[:, 9] == 0).all()


def test_rows_that_adjust_nothing_need_no_history_and_the_others_must_have_one():
    logits = torch.randn(2, 3, V)
    plain = [SamplingParams(temperature=0.7), SamplingParams(temperature=0)]
    assert torch.equal(processed_probs(logits, plain), processed_probs(logits, plain, [None, None]))
    assert adjusted_logits(logits, plain) is not None
    with pytest.raises(ValueError, match="need one History per row"):
        processed_probs(logits, [PENALISED[0], plain[0]])
    with pytest.raises(ValueError, match="its History is None"):
        processed_probs(logits, [PENALISED[0], plain[0]], [None, None])


def test_logprobs_score_each_token_after_the_ones_before_it_and_prompt_logprobs_as_a_first_token():
    sp = SamplingParams(temperature=0.8, frequency_penalty=1.0, repetition_penalty=1.4, min_tokens=2, logprobs=2,
                        prompt_logprobs=1)
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(size=(5, V)).astype(np.float32))
    tokens = [3, 3, 5, 3, 1]
    got = token_logprobs(logits, tokens, sp, history=History([2], [3], (EOS,)))
    for i, entry in enumerate(got):
        want = processed_logprobs(logits[i:i + 1], [sp], [History([2], [3] + tokens[:i], (EOS,))])[0]
        assert entry.logprob == pytest.approx(float(want[tokens[i]]), abs=1e-6)
    prompt = [4, 2, EOS, 4, 7, 2]
    scored = prompt_logprobs(torch.from_numpy(rng.normal(size=(6, V)).astype(np.float32)), prompt, sp, (EOS,))
    assert scored[0] is None and scored[2].logprob == -math.inf  # EOS in the prompt: min_tokens holds it back
    again = prompt_logprobs(torch.zeros(6, V), prompt, sp, (EOS,))
    # Position j scores prompt[j + 1] after prompt[:j + 1], nothing of it output: only repetition applies.
    for j in range(1, len(prompt)):
        want = reference_adjusted(np.zeros(V), sp, prompt[:j], [])
        with np.errstate(divide="ignore"):  # the log of a masked token's 0
            ref = np.log(reference_probs(want, sp))
        assert again[j].logprob == pytest.approx(ref[prompt[j]], abs=1e-5), j


# ---- verification ---------------------------------------------------------------------------------


def test_greedy_verify_with_penalties_emits_plain_greedy_decoding():
    """A target whose next-token logits depend on the previous token; greedy decoding with every
    adjustment, one token at a time, and speculative rounds with a noisy draft's proposals (the
    first of which always agrees) must emit the same tokens."""
    g = torch.Generator().manual_seed(5)
    table = torch.randn(V, V, generator=g) * 2
    sp = SamplingParams(temperature=0, frequency_penalty=1.1, presence_penalty=0.3, repetition_penalty=1.7,
                        logit_bias={2: 1.5}, bad_words_ids=[[3, 4]], min_tokens=6, stop_token_ids=[5], max_tokens=20)
    prompt, plain = [1, 3], []
    for _ in range(16):
        last = (prompt + plain)[-1]
        plain.append(int(greedy_tokens(table[last][None], [sp], [History(prompt, plain, (EOS,))])))
    out, k = [], 4
    while len(out) < 16:
        last = (prompt + out)[-1]
        proposals = [plain[len(out)]] + torch.randint(0, V, (k - 1,), generator=g).tolist()
        rows = table[torch.tensor([last] + proposals)][None]
        result = verify(rows, torch.tensor([proposals]), torch.tensor([k]), None, torch.tensor([True]), [sp], None,
                        [History(prompt, out, (EOS,))])
        n = int(result.num_accepted[0])
        out += proposals[:n] + [int(result.bonus[0])]
    assert out[:16] == plain
    assert plain != [int(table[x].argmax()) for x in ([1, 3] + plain)[1:17]]  # the penalties changed the output


# ---- where they are refused or exposed --------------------------------------------------------------


def test_the_tensorrt_llm_target_refuses_them_and_the_cli_takes_them():
    from trtssd.cli import build_parser
    from trtssd.trtllm.executor_target import check_supported

    for params in PENALISED:
        with pytest.raises(ValueError, match="bad_words_ids and min_tokens must be off with the TensorRT-LLM"):
            check_supported(dataclasses.replace(params, min_p=0.0))
    check_supported(SamplingParams(temperature=0.7))
    args = build_parser().parse_args(["generate", "--presence-penalty", "0.5", "--frequency-penalty", "-1",
                                      "--repetition-penalty", "1.2", "--min-tokens", "3"])
    assert (args.presence_penalty, args.frequency_penalty, args.repetition_penalty, args.min_tokens) == (0.5, -1, 1.2, 3)


class CharTokenizer:
    """Token id = a character's code point (what the detokenizer needs: decode)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_under_min_tokens_a_stop_string_counts_only_from_the_min_tokens_th_token():
    from trtssd.text.detokenizer import IncrementalDetokenizer

    def text(min_tokens: int, tokens: str = "xabyabz") -> tuple[str, int]:
        detok = IncrementalDetokenizer(CharTokenizer(), ["ab"], min_tokens)
        for n, c in enumerate(tokens, start=1):
            detok.add(ord(c))
            if detok.stop_string is not None:
                return detok.text, n
        return detok.text + detok.finish(), len(tokens)

    assert text(0) == ("x", 3)  # the stop completes at token 3
    assert text(3) == ("x", 3)  # ... which is the min_tokens-th: it counts
    assert text(4) == ("xaby", 6)  # before the 4th token it is text; the next one ends the output
    assert text(7) == ("xabyabz", 7)
