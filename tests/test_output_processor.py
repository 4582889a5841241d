"""The output processor on the target loop's token outputs: stream deltas that join to the final
text and are never taken back, stop strings that end the output at the token completing them
however tokens are grouped into rounds, and bounded work per token (SmolLM2's tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass

from token_text import MIXED_TEXT, CountingTokenizer, one_token, token_ids
from trtssd.text.output_processor import OutputText, request_output
from trtssd.runtime.sequence import Sequence
from trtssd.sampling import SamplingParams


@dataclass
class Streamed:
    output: list[int]  # the output's token ids, cut where a stop string ended it
    text: str
    deltas: list  # the output processor's Delta per step
    finish_reason: str | None


def _stream(tok, params: SamplingParams, rounds: list[list[int]]) -> Streamed:
    """Emit rounds of tokens as the target's rounds would, each step's output through the output
    processor, and end where a stop string completes, as `LLM` and the server tell the loop."""
    seq = Sequence(0, "r", [1], params, None, eos_token_ids=(tok.eos_token_id,))
    text, deltas = OutputText(tok, params.stop), []
    for tokens in rounds:
        deltas.append(text.add(seq.emit(tokens)))
        if text.stop_at is not None or seq.finish_reason:
            break
    if text.stop_at is not None:
        return Streamed(seq.output[:text.stop_at], text.text, deltas, "stop")
    return Streamed(seq.output, text.text, deltas, seq.finish_reason)


def test_a_stop_string_straddling_two_steps_is_never_sent_then_taken_back(smollm2):
    """The reported case: 'F', then 'A' (could start the stop 'AX'), then 'X' completes it. The old
    code sent 'F', 'A', then the whole cut text 'F' again."""
    F, A, X = (one_token(smollm2, c) for c in "FAX")
    got = _stream(smollm2, SamplingParams(max_tokens=10, stop=("AX",)), [[F], [A], [X]])
    assert [d.text for d in got.deltas] == ["F", "", ""]
    assert got.text == "F" and got.finish_reason == "stop"
    assert got.output == [F, A, X]  # cut after the token that completed the stop string
    assert got.deltas[-1].stop_at == 3


def test_held_text_that_turns_out_not_to_be_a_stop_is_sent_later(smollm2):
    F, A, B = (one_token(smollm2, c) for c in "FAB")
    got = _stream(smollm2, SamplingParams(max_tokens=3, stop=("AX",)), [[F], [A], [B]])
    assert [d.text for d in got.deltas] == ["F", "", "AB"]
    assert got.text == "FAB" and got.finish_reason == "length"


def test_held_text_is_flushed_when_the_request_ends_otherwise(smollm2):
    F, A = (one_token(smollm2, c) for c in "FA")
    eos = smollm2.eos_token_id
    got = _stream(smollm2, SamplingParams(max_tokens=2, stop=("AX",)), [[F], [A]])
    assert [d.text for d in got.deltas] == ["F", "A"] and got.finish_reason == "length"
    got = _stream(smollm2, SamplingParams(max_tokens=9, stop=("AX",)), [[F, A, eos, F]])
    assert got.deltas[0].text == "FA" and got.text == "FA" and got.output == [F, A, eos]
    # An incomplete character at max_tokens goes out as it decodes (U+FFFD), like the full decode.
    part = token_ids(smollm2, "世")[:-1]
    got = _stream(smollm2, SamplingParams(max_tokens=len(part)), [part])
    assert got.text == smollm2.decode(part) and got.text.endswith("\ufffd")


def _kept(seq: Sequence, tokens: list[int], outputs: list) -> int:
    """Emit ``tokens`` as a round would; how many the sequence kept."""
    outputs.append(seq.emit(tokens))
    return len(outputs[-1].new_token_ids)


def test_emit_stops_at_stop_tokens_and_the_processor_at_stop_strings(smollm2):
    F, A, X, B = (one_token(smollm2, c) for c in "FAXB")
    seq, outputs = Sequence(0, "r", [1], SamplingParams(max_tokens=3), None), []
    assert _kept(seq, [F, A, X, B], outputs) == 3 and seq.finish_reason == "length"
    seq, outputs = Sequence(1, "r", [1], SamplingParams(max_tokens=10, stop_token_ids=(A,)), None), []
    assert _kept(seq, [F, A, X], outputs) == 2 and seq.finish_reason == "stop"
    # The loop knows no stop strings: the processor cuts the delta at the token completing one.
    seq, outputs = Sequence(2, "r", [1], SamplingParams(max_tokens=10, stop=("AX",)), None), []
    text = OutputText(smollm2, ("AX",))
    assert _kept(seq, [F, A], outputs) == 2 and _kept(seq, [X, B, B], outputs) == 3
    assert text.add(outputs[0]).stop_at is None
    delta = text.add(outputs[1])
    assert delta.token_ids == (X,) and delta.stop_at == 3 and text.text == "F"
    assert text.add(outputs[1]) is None  # what the loop emits until it learns of the stop is dropped


def test_each_token_of_a_round_carries_its_own_delta(smollm2):
    ids = token_ids(smollm2, MIXED_TEXT)
    rounds = [ids[i:i + 4] for i in range(0, len(ids), 4)]
    got = _stream(smollm2, SamplingParams(max_tokens=len(ids)), rounds)
    for delta in got.deltas:
        assert len(delta.token_texts) == len(delta.token_ids) and "".join(delta.token_texts) == delta.text
    pieces = [t for delta in got.deltas for t in delta.token_texts]
    assert "".join(pieces) == got.text == MIXED_TEXT
    assert not any("\ufffd" in d for d in pieces)  # a split character goes out whole, once
    assert sum(1 for d in pieces if d) > len(MIXED_TEXT.split())  # per token, not per round


def test_the_stop_does_not_depend_on_how_tokens_are_grouped_into_rounds(smollm2):
    """A speculative round commits several tokens at once; ar commits one. Same tokens, same
    output."""
    ids = token_ids(smollm2, "The quick brown fox jumps over the lazy dog.")
    # "brown" completes first, though "quick brown fox" starts earlier: the old code cut the
    # text at whichever started first among the stops in a whole round's text.
    params = SamplingParams(max_tokens=len(ids), stop=("quick brown fox", "brown"))
    results = set()
    for size in (1, 2, 3, len(ids)):
        got = _stream(smollm2, params, [ids[i:i + size] for i in range(0, len(ids), size)])
        results.add((got.text, tuple(got.output)))
    assert results == {("The quick ", tuple(ids[:len(token_ids(smollm2, "The quick brown"))]))}


def test_work_per_token_stays_bounded_in_the_output_processor(smollm2):
    """The old code decoded the whole output at every emit: quadratic in its length."""
    ids = token_ids(smollm2, MIXED_TEXT * 40)
    counting = CountingTokenizer(smollm2)
    counting.eos_token_id = smollm2.eos_token_id
    got = _stream(counting, SamplingParams(max_tokens=len(ids), stop=("never seen",)), [[t] for t in ids])
    assert got.text == MIXED_TEXT * 40 and len(ids) > 1000
    assert counting.longest <= 8  # a window of a few tokens, however long the output
    assert counting.calls <= 2 * len(ids) + 2 and counting.ids_decoded <= 8 * len(ids)


def test_the_record_counts_the_prompt_tokens_the_prefix_cache_gave(smollm2):
    F, A = (one_token(smollm2, c) for c in "FA")
    for cached in (0, 3):  # 0: no prefix caching
        seq = Sequence(0, "r", [1, 2, 3, 4], SamplingParams(max_tokens=2), None, num_cached_tokens=cached)
        seq.output, seq.finish_reason, seq.finish_time = [F, A], "length", seq.arrival + 1.0
        record = request_output([seq], [OutputText(smollm2)])
        assert record.num_cached_tokens == cached
        assert record.usage["prompt_tokens_details"] == {"cached_tokens": cached}
    assert Sequence(1, "r", [1], SamplingParams(), None).num_cached_tokens == 0
