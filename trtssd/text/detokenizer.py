"""Incremental detokenization with stop strings: token ids in, text deltas out.

Decoding a whole output again for every new token costs time quadratic in its length. Decoding
one token alone is wrong for most tokenizers: SentencePiece drops a leading space at the start of
what it decodes, and byte-level BPE splits one character (CJK, emoji) over several tokens whose
bytes alone decode to U+FFFD. `IncrementalDecoder` uses the prefix/read-offset technique of vLLM
and TGI: it decodes a short window that starts with a few tokens already turned into text (the
context) and sends what the window's text adds past the context's own text, and it waits while
the window's text ends in U+FFFD (a character still incomplete).

tokenizers' own `decoders.DecodeStream` does the same in Rust and is not used here: on a
byte-fallback tokenizer (Llama-2's layout) it raises "Invalid prefix" at a run of byte tokens
that is not valid UTF-8, which a sampled output can hold (tests/test_detokenizer.py), and it has
no flush for an incomplete character at the end of an output.

`IncrementalDetokenizer` adds stop strings on top. It holds back any trailing text that could
still become a stop string, so nothing it sends is ever taken back: the concatenation of its
deltas is always the final text, and the final text ends right before the stop string. Under
``min_tokens`` (SamplingParams) a stop string counts only once the output has that many tokens, as
vLLM checks them: one completed before is text like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what a decoder makes of bytes that are not (yet) a whole character

# A character is at most 4 UTF-8 bytes, so a real one is complete within a few tokens. A model
# that keeps emitting invalid bytes (or special tokens, which decode to nothing) would otherwise
# make the window, and the work per token, grow without end: past this many tokens waiting, their
# text is sent as it decodes, U+FFFD included.
MAX_PENDING_TOKENS = 16


class IncrementalDecoder:
    """Text of a growing token list, produced per token by decoding a bounded window.

    The window is `context + pending`: context tokens were already turned into text (their text,
    decoded alone, is `_context_text`); pending tokens have been added but their text not yet
    released. Their text is the window's text past the context's text.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._window: list[int] = []
        self._read = 0  # window[:_read] is the context
        self._context_text = ""

    def add(self, token_id: int) -> tuple[str, str]:
        """Add one token. Returns (released, tentative): `released` is final text to append;
        `tentative` is text already decoded but held because it ends in an incomplete character,
        minus that character (it may still change, so it is only for looking ahead)."""
        self._window.append(token_id)
        text = self._decode(self._window)
        added = text[len(self._context_text):]
        # Nothing new yet (a skipped special token, a space SentencePiece drops at the start) or
        # an incomplete character: wait, keeping the context, which gives the next tokens' text
        # its right neighbours.
        waiting = not added or added.endswith(REPLACEMENT)
        pending = len(self._window) - self._read
        if waiting and pending <= MAX_PENDING_TOKENS:
            # Byte-fallback decoders turn a whole run of byte tokens into U+FFFDs until it is
            # valid, context included: then nothing of it is worth a look ahead.
            return "", added.rstrip(REPLACEMENT) if text.startswith(self._context_text) else ""
        if waiting:
            log.debug("%d tokens without a complete character; sending %r as is", pending, added)
        self._advance()
        return added, ""

    def flush(self) -> str:
        """The text of every pending token, as it decodes now (incomplete characters included)."""
        added = self._decode(self._window)[len(self._context_text):]
        self._advance()
        return added

    def _advance(self) -> None:
        """The pending tokens become the context: the tokens before them are no longer needed."""
        del self._window[: self._read]
        self._read = len(self._window)
        self._context_text = self._decode(self._window)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=True)  # as the full decode always was


class IncrementalDetokenizer:
    """Per-token text deltas of one sequence, cut at the first stop string.

    `add` returns the text that is safe to send after each token. When a stop string completes,
    `stop_string` is set: the text ends right before it and no more tokens may be added. When the
    sequence ends for another reason, `finish` returns the text still held back.
    """

    def __init__(self, tokenizer, stop: Iterable[str] = (), min_tokens: int = 0):
        self._decoder = IncrementalDecoder(tokenizer)
        self._stops = tuple(s for s in stop if s)
        self._min_tokens = min_tokens
        self._tokens = 0  # tokens added so far
        self._held = ""  # decoded text not sent yet: its end could be the start of a stop string
        self._sent: list[str] = []
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """Everything sent so far: the final text once stopped or finished."""
        return "".join(self._sent)

    def add(self, token_id: int) -> str:
        if self.stop_string is not None:
            raise RuntimeError("tokens added after a stop string")
        released, tentative = self._decoder.add(token_id)
        self._tokens += 1
        candidate = self._held + released
        # Look into the tentative text too, so the stop is found at the token that completes it
        # even when a later incomplete character holds the decoder's text back.
        cut = self._until_stop(candidate + tentative) if self._tokens >= self._min_tokens else None
        if cut is not None:
            return self._send(cut, "")
        keep = len(candidate) - held_back(candidate, self._stops)
        return self._send(candidate[:keep], candidate[keep:])

    def finish(self) -> str:
        """The held-back text, for a sequence that ended without a stop string."""
        if self.stop_string is not None:
            return ""
        candidate = self._held + self._decoder.flush()
        # A stop found only now is one that the incomplete character's U+FFFD took part in.
        cut = self._until_stop(candidate) if self._tokens >= self._min_tokens else None
        return self._send(candidate if cut is None else cut, "")

    def _until_stop(self, text: str) -> str | None:
        """``text`` before the stop string that starts first in it (which ends the sequence), or
        None when it holds none."""
        hits = [(text.find(stop), stop) for stop in self._stops if stop in text]
        if not hits:
            return None
        start, self.stop_string = min(hits, key=lambda hit: hit[0])
        return text[:start]

    def _send(self, delta: str, held: str) -> str:
        self._held = held
        if delta:
            self._sent.append(delta)
        return delta


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of text that is the beginning of a stop string (which the next
    tokens could complete)."""
    ends = [n for stop in stops for n in range(1, min(len(stop), len(text) + 1)) if text.endswith(stop[:n])]
    return max(ends, default=0)
