"""Token-text helpers shared by the detokenizer and output-processor tests."""

from __future__ import annotations

MIXED_TEXT = "Hi 世界! naïve café 🎉🎉 — ok 你好 😀 the end."  # CJK and emoji: several tokens each


def token_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def one_token(tok, text: str) -> int:
    ids = token_ids(tok, text)
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
