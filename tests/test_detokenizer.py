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

from token_text import MIXED_TEXT, CountingTokenizer, one_token, token_ids
from trtssd.text.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer

CORPUS = ["Hello world, this is a tiny corpus.", "The quick brown fox jumps over the lazy dog.",
          "naïve café, 世界 你好 🎉 ok"] * 20


# --- tokenizers ------------------------------------------------------------------------------


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


# --- the detokenizer on its own, over three tokenizers ---------------------------------------


def test_text_round_trips_with_whole_characters_per_delta(tokenizer):
    ids = token_ids(tokenizer, MIXED_TEXT)
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
    ids = token_ids(tokenizer, text)
    deltas, detok, used = _run(tokenizer, ids, stops)
    assert "".join(deltas) == detok.text == expected
    if detok.stop_string is not None:
        # Tokens are kept up to the one that completes the stop string, and no further.
        assert any(s in tokenizer.decode(ids[:used]) for s in stops)
        assert not any(s in tokenizer.decode(ids[:used - 1]) for s in stops)
    else:
        assert used == len(ids)


def test_a_stop_string_fed_one_character_token_at_a_time_is_never_sent(smollm2):
    ids = [one_token(smollm2, c) for c in "xaababc"]
    deltas, detok, used = _run(smollm2, ids, ("abab", "abc"))
    assert deltas == ["x", "", "a", "", "", "", ""] and detok.text == "xa" and used == 6
    assert detok.stop_string == "abab"


def test_tokens_after_a_stop_are_refused(smollm2):
    detok = IncrementalDetokenizer(smollm2, ("F",))
    detok.add(one_token(smollm2, "F"))
    with pytest.raises(RuntimeError, match="after a stop string"):
        detok.add(one_token(smollm2, "A"))


def test_invalid_bytes_forever_keep_the_window_bounded(smollm2):
    """A model that emits bytes that never make a character: U+FFFD goes out as it is after a
    while, rather than the window growing with the output."""
    lone = _byte_token(smollm2, 0x80)  # a continuation byte with nothing to continue
    ids = [one_token(smollm2, "F")] + [lone] * 200 + [one_token(smollm2, "A")]
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
    ids = token_ids(tok, MIXED_TEXT * 60)
    counting = CountingTokenizer(tok)
    deltas, detok, _ = _run(counting, ids, ("never seen", "Hi 世界?"))
    assert "".join(deltas) == MIXED_TEXT * 60 and len(ids) >= 1000
    assert counting.longest <= 8
    assert counting.calls <= 2 * len(ids) + 2 and counting.ids_decoded <= 8 * len(ids)


def test_tokenizers_decode_stream_raises_where_our_decoder_goes_on(sentencepiece_like):
    """Why IncrementalDecoder is not tokenizers' DecodeStream: on a byte-fallback tokenizer, a
    run of byte tokens that is not valid UTF-8 (a sampled output can hold one) makes DecodeStream
    raise, which would fail the request. Our decoder sends such bytes as U+FFFD and goes on (how
    many U+FFFD a run becomes can differ from the full decode, which groups the run whole)."""
    from tokenizers.decoders import DecodeStream

    backend = sentencepiece_like.backend_tokenizer
    rng = random.Random(0)
    raised = 0
    for _ in range(40):
        ids = [rng.randrange(len(sentencepiece_like)) for _ in range(40)]
        stream = DecodeStream(skip_special_tokens=True)
        try:
            for i in ids:
                stream.step(backend, i)
        except Exception:  # noqa: BLE001 - tokenizers raises a plain Exception ("Invalid prefix")
            raised += 1
        deltas, detok, _ = _run(sentencepiece_like, ids)
        assert "".join(deltas) == detok.text
    assert raised > 20
