"""Incremental detokenization and stop strings: the streamed deltas always join
to the final text, nothing sent is taken back, the final text is the full decode cut before the
first stop string, and the work per token stays bounded however long the output.

Real tokenizers, all offline: SmolLM2's (byte-level BPE, the default engine's) and two built here
with `tokenizers`: a byte-level BPE and a SentencePiece-style BPE (Metaspace, byte fallback, a
decoder that strips the leading space), each trained on a few sentences so that CJK and emoji
come out as several tokens."""

from __future__ import annotations

import json
import random

import pytest

from trtssd.config import SpeculativeConfig
from trtssd.runtime.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from trtssd.runtime.target_loop import Sequence, TargetLoop
from trtssd.sampling import SamplingParams

CORPUS = ["Hello world, this is a tiny corpus.", "The quick brown fox jumps over the lazy dog.",
          "naïve café, 世界 你好 🎉 ok"] * 20
MIXED_TEXT = "Hi 世界! naïve café 🎉🎉 — ok 你好 😀 the end."


# --- tokenizers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from trtssd.build import default_engine
    from trtssd.models.tokenizer import load_tokenizer

    return load_tokenizer(default_engine())


def _wrap(backend, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


@pytest.fixture(scope="module")
def byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return _wrap(tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def sentencepiece_like():
    """Llama-2's layout: '▁' for spaces, <0xXX> byte tokens, one leading space stripped on decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>", "</s>"], show_progress=False,
                                  limit_alphabet=40)
    tok.train_from_iterator(CORPUS, trainer)
    # The trainer knows nothing of byte fallback: give the model its 256 byte tokens.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return _wrap(Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>")


TOKENIZERS = ["smollm2", "byte_level", "sentencepiece_like"]
# Random id streams per tokenizer in the property tests (300 cost CI 36 s on the SmolLM2 tokenizer).
RANDOM_STREAMS = 150


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request):
    return request.getfixturevalue(request.param)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _one_token(tok, text: str) -> int:
    ids = _ids(tok, text)
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens"
    return ids[0]


class CountingTokenizer:
    """A tokenizer that counts its decode calls and the token ids they decode."""

    def __init__(self, tok):
        self._tok = tok
        self.calls = 0
        self.ids_decoded = 0
        self.longest = 0

    def decode(self, ids, **kwargs):
        self.calls += 1
        self.ids_decoded += len(ids)
        self.longest = max(self.longest, len(ids))
        return self._tok.decode(ids, **kwargs)


def _run(tok, ids: list[int], stop=()) -> tuple[list[str], IncrementalDetokenizer, int]:
    """Deltas for ids one by one (until a stop string), then the flush; and how many ids were used."""
    detok = IncrementalDetokenizer(tok, stop)
    deltas, used = [], 0
    for tok_id in ids:
        deltas.append(detok.add(tok_id))
        used += 1
        if detok.stop_string is not None:
            break
    deltas.append(detok.finish())
    return deltas, detok, used


# --- the target loop: what a request streams -------------------------------------------------


def _loop(tok) -> TargetLoop:
    # _emit needs only the tokenizer and the EOS ids: no executor, no draft.
    return TargetLoop(None, SpeculativeConfig(mode="ar"), max_batch=1, tokenizer=tok,
                      eos_token_ids=(tok.eos_token_id,))


def _stream(loop: TargetLoop, params: SamplingParams, rounds: list[list[int]]):
    """Emit rounds of tokens as the target's rounds would; returns the sequence and its outputs."""
    seq = Sequence(0, [1], params, None)
    outputs = []
    for tokens in rounds:
        loop._emit(seq, tokens, outputs)
        if seq.finish_reason:
            break
    return seq, outputs


def test_a_stop_string_straddling_two_steps_is_never_sent_then_taken_back(smollm2):
    """The reported case: 'F', then 'A' (could start the stop 'AX'), then 'X' completes it. The old
    code sent 'F', 'A', then the whole cut text 'F' again."""
    F, A, X = (_one_token(smollm2, c) for c in "FAX")
    seq, outputs = _stream(_loop(smollm2), SamplingParams(max_tokens=10, stop=("AX",)), [[F], [A], [X]])
    assert [o.text_delta for o in outputs] == ["F", "", ""]
    assert seq.text == "F" and seq.finish_reason == "stop"
    assert seq.output == [F, A, X]  # cut after the token that completed the stop string
    assert outputs[-1].finished


def test_held_text_that_turns_out_not_to_be_a_stop_is_sent_later(smollm2):
    F, A, B = (_one_token(smollm2, c) for c in "FAB")
    seq, outputs = _stream(_loop(smollm2), SamplingParams(max_tokens=3, stop=("AX",)), [[F], [A], [B]])
    assert [o.text_delta for o in outputs] == ["F", "", "AB"]
    assert seq.text == "FAB" and seq.finish_reason == "length"


def test_held_text_is_flushed_when_the_request_ends_otherwise(smollm2):
    F, A = (_one_token(smollm2, c) for c in "FA")
    eos = smollm2.eos_token_id
    seq, outputs = _stream(_loop(smollm2), SamplingParams(max_tokens=2, stop=("AX",)), [[F], [A]])
    assert [o.text_delta for o in outputs] == ["F", "A"] and seq.finish_reason == "length"
    seq, outputs = _stream(_loop(smollm2), SamplingParams(max_tokens=9, stop=("AX",)), [[F, A, eos, F]])
    assert outputs[0].text_delta == "FA" and seq.text == "FA" and seq.output == [F, A, eos]
    # An incomplete character at max_tokens goes out as it decodes (U+FFFD), like the full decode.
    part = _ids(smollm2, "世")[:-1]
    seq, outputs = _stream(_loop(smollm2), SamplingParams(max_tokens=len(part)), [part])
    assert seq.text == smollm2.decode(part) and seq.text.endswith("\ufffd")


def test_emit_keeps_tokens_up_to_the_stop_and_says_how_many(smollm2):
    F, A, X, B = (_one_token(smollm2, c) for c in "FAXB")
    loop = _loop(smollm2)
    seq, outputs = Sequence(0, [1], SamplingParams(max_tokens=10, stop=("AX",)), None), []
    assert loop._emit(seq, [F, A], outputs) == 2
    assert loop._emit(seq, [X, B, B], outputs) == 1  # X completes the stop; the Bs are cut
    assert seq.output == [F, A, X] and outputs[-1].new_token_ids == [X]
    seq, outputs = Sequence(1, [1], SamplingParams(max_tokens=3), None), []
    assert loop._emit(seq, [F, A, X, B], outputs) == 3 and seq.finish_reason == "length"
    seq, outputs = Sequence(2, [1], SamplingParams(max_tokens=10, stop_token_ids=(A,)), None), []
    assert loop._emit(seq, [F, A, X], outputs) == 2 and seq.text == "FA"


def test_each_token_of_a_round_carries_its_own_delta(smollm2):
    ids = _ids(smollm2, MIXED_TEXT)
    rounds = [ids[i:i + 4] for i in range(0, len(ids), 4)]
    seq, outputs = _stream(_loop(smollm2), SamplingParams(max_tokens=len(ids)), rounds)
    for out in outputs:
        assert len(out.token_deltas) == len(out.new_token_ids) and "".join(out.token_deltas) == out.text_delta
    pieces = [d for out in outputs for d in out.token_deltas]
    assert "".join(pieces) == seq.text == MIXED_TEXT
    assert not any("\ufffd" in d for d in pieces)  # a split character goes out whole, once
    assert sum(1 for d in pieces if d) > len(MIXED_TEXT.split())  # per token, not per round


def test_the_stop_does_not_depend_on_how_tokens_are_grouped_into_rounds(smollm2):
    """A speculative round commits several tokens at once; ar commits one. Same tokens, same
    output."""
    ids = _ids(smollm2, "The quick brown fox jumps over the lazy dog.")
    # "brown" completes first, though "quick brown fox" starts earlier: the old code cut the
    # text at whichever started first among the stops in a whole round's text.
    params = SamplingParams(max_tokens=len(ids), stop=("quick brown fox", "brown"))
    results = set()
    for size in (1, 2, 3, len(ids)):
        seq, _ = _stream(_loop(smollm2), params, [ids[i:i + size] for i in range(0, len(ids), size)])
        results.add((seq.text, tuple(seq.output)))
    assert results == {("The quick ", tuple(ids[:len(_ids(smollm2, "The quick brown"))]))}


def test_work_per_token_stays_bounded_in_the_loop(smollm2):
    """The old code decoded the whole output at every emit: quadratic in its length."""
    ids = _ids(smollm2, MIXED_TEXT * 40)
    counting = CountingTokenizer(smollm2)
    loop = _loop(smollm2)
    loop.tokenizer = counting
    seq, outputs = _stream(loop, SamplingParams(max_tokens=len(ids), stop=("never seen",)), [[t] for t in ids])
    assert seq.text == MIXED_TEXT * 40 and len(ids) > 1000
    assert counting.longest <= 8  # a window of a few tokens, however long the output
    assert counting.calls <= 2 * len(ids) + 2 and counting.ids_decoded <= 8 * len(ids)


# --- the detokenizer on its own, over three tokenizers ---------------------------------------


def test_text_round_trips_with_whole_characters_per_delta(tokenizer):
    ids = _ids(tokenizer, MIXED_TEXT)
    assert len(ids) > len(MIXED_TEXT.split()) * 2  # CJK and emoji are split over several tokens
    # Tokens decoded one by one lose characters (and, SentencePiece, spaces): the test can fail.
    assert "".join(tokenizer.decode([i]) for i in ids) != MIXED_TEXT
    deltas, detok, _ = _run(tokenizer, ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text, stops, expected", [
    ("Hi 世界! ok", ("界!",), "Hi 世"),  # multi-byte stop string, spread over several tokens
    ("Hi 世界! ok", ("🎉", "世"), "Hi "),
    ("naïve café 🎉🎉 ok", ("🎉🎉",), "naïve café "),
    ("The quick brown fox", (" qu", " quick"), "The"),  # one stop is a prefix of another
    ("The quick brown fox", ("quick brown", "brown"), "The "),  # the one that starts first wins
    ("ababc", ("abc",), "ab"),  # overlapping partial matches
    ("aaab", ("aab",), "a"),
    ("abcabd", ("abd",), "abc"),
    ("no stop here", ("xyz", "here!"), "no stop here"),
])
def test_stop_strings(tokenizer, text, stops, expected):
    ids = _ids(tokenizer, text)
    deltas, detok, used = _run(tokenizer, ids, stops)
    assert "".join(deltas) == detok.text == expected
    if detok.stop_string is not None:
        # Tokens are kept up to the one that completes the stop string, and no further.
        assert any(s in tokenizer.decode(ids[:used]) for s in stops)
        assert not any(s in tokenizer.decode(ids[:used - 1]) for s in stops)
    else:
        assert used == len(ids)


def test_a_stop_string_fed_one_character_token_at_a_time_is_never_sent(smollm2):
    ids = [_one_token(smollm2, c) for c in "xaababc"]
    deltas, detok, used = _run(smollm2, ids, ("abab", "abc"))
    assert deltas == ["x", "", "a", "", "", "", ""] and detok.text == "xa" and used == 6
    assert detok.stop_string == "abab"


def test_tokens_after_a_stop_are_refused(smollm2):
    detok = IncrementalDetokenizer(smollm2, ("F",))
    detok.add(_one_token(smollm2, "F"))
    with pytest.raises(RuntimeError, match="after a stop string"):
        detok.add(_one_token(smollm2, "A"))


def test_invalid_bytes_forever_keep_the_window_bounded(smollm2):
    """A model that emits bytes that never make a character: U+FFFD goes out as it is after a
    while, rather than the window growing with the output."""
    lone = _byte_token(smollm2, 0x80)  # a continuation byte with nothing to continue
    ids = [_one_token(smollm2, "F")] + [lone] * 200 + [_one_token(smollm2, "A")]
    counting = CountingTokenizer(smollm2)
    deltas, detok, _ = _run(counting, ids)
    assert "".join(deltas) == smollm2.decode(ids) == "F" + "\ufffd" * 200 + "A"
    assert counting.longest <= 2 * MAX_PENDING_TOKENS + 2


def _byte_token(tok, byte: int) -> int:
    """The id of a byte-level BPE's token for one byte (GPT-2's printable stand-ins)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_in = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in stand_in:
            stand_in[b] = chr(256 + extra)
            extra += 1
    return tok.convert_tokens_to_ids(stand_in[byte])


# --- random token streams against the full decode --------------------------------------------


def _random_ids(tok, rng: random.Random, valid_bytes_only: bool) -> list[int]:
    """Random ids, rich in byte tokens and special tokens. With valid_bytes_only, byte tokens
    come only as whole UTF-8 characters: a byte-fallback decoder turns a whole run of byte tokens
    into U+FFFDs as soon as one of them is invalid, including bytes that were already valid
    characters, which no stream can match without taking text back."""
    vocab = tok.get_vocab()
    specials = tok.all_special_ids
    if valid_bytes_only:
        bytes_ = {int(t[3:5], 16): i for t, i in vocab.items() if len(t) == 6 and t.startswith("<0x")}
        pieces = [i for t, i in vocab.items() if i not in bytes_.values() and i not in specials]
        chars = "aé世界🎉你好 ñ€😀—ï"
        ids = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            if r < 0.4:
                ids += [bytes_[b] for b in rng.choice(chars).encode()]
            elif r < 0.45:
                ids.append(rng.choice(specials))
            else:
                ids.append(rng.choice(pieces))
        return ids
    short = [i for t, i in vocab.items() if len(t) <= 2]  # single bytes and pairs: split characters
    return [rng.choice(specials) if (r := rng.random()) < 0.05 else rng.choice(short) if r < 0.6
            else rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]


def _reference(tok, ids: list[int], stops: tuple[str, ...]) -> tuple[str, int]:
    """The old, quadratic semantics, one token per round: decode everything after every token;
    the first time a stop string appears, the text ends before the one that starts first."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        starts = [text.find(s) for s in stops if s in text]
        if starts:
            return text[:min(starts)], k
    return tok.decode(ids, skip_special_tokens=True), len(ids)


def _random_stops(rng: random.Random, text: str) -> tuple[str, ...]:
    """Pieces of the text itself (so they are hit, often across tokens) and near misses."""
    stops = []
    clean = text.replace("\ufffd", "")  # a stop string is text; U+FFFD is not
    for _ in range(rng.randint(1, 3)):
        if len(clean) < 2:
            break
        start = rng.randrange(len(clean) - 1)
        piece = clean[start:start + rng.randint(1, 4)]
        stops.append(piece + ("#" if rng.random() < 0.3 else ""))
    return tuple(s for s in stops if s)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_random_streams_join_to_the_full_decode(request, name):
    tok = request.getfixturevalue(name)
    rng = random.Random(12)
    for _ in range(RANDOM_STREAMS):
        ids = _random_ids(tok, rng, valid_bytes_only=name == "sentencepiece_like")
        deltas, detok, _ = _run(tok, ids)
        assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("name", TOKENIZERS)
def test_random_streams_with_stop_strings_match_the_full_decode(request, name):
    tok = request.getfixturevalue(name)
    rng = random.Random(4)
    stopped = 0
    for _ in range(RANDOM_STREAMS):
        ids = _random_ids(tok, rng, valid_bytes_only=name == "sentencepiece_like")
        stops = _random_stops(rng, tok.decode(ids, skip_special_tokens=True))
        deltas, detok, used = _run(tok, ids, stops)
        assert ("".join(deltas), used) == (detok.text, used) == _reference(tok, ids, stops), (ids, stops)
        stopped += detok.stop_string is not None
    assert stopped > RANDOM_STREAMS // 3  # the stops were often hit, not just missed


@pytest.mark.parametrize("name", TOKENIZERS)
def test_long_output_decodes_a_bounded_window_per_token(request, name):
    tok = request.getfixturevalue(name)
    ids = _ids(tok, MIXED_TEXT * 60)
    counting = CountingTokenizer(tok)
    deltas, detok, _ = _run(counting, ids, ("never seen", "Hi 世界?"))
    assert "".join(deltas) == MIXED_TEXT * 60 and len(ids) >= 1000
    assert counting.longest <= 8
    assert counting.calls <= 2 * len(ids) + 2 and counting.ids_decoded <= 8 * len(ids)
