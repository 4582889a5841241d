"""An `LLM` on the tiny pair with its draft worker in this process (`launch="local"`, no MPI), the
prompts the target loop's tests share, and a stand-in for load control that fixes which rounds
speculate."""

from __future__ import annotations

from pathlib import Path

from trtssd import LLM, ModelRef

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12, [3, 1, 4, 1, 5, 9, 2, 6], [42], [5, 6] * 5]


def local_llm(pair: tuple[Path, Path], mode: str, draft: Path | None = None, **kw) -> LLM:
    """``pair``'s target with its draft (or ``draft``) in this process, max_model_len 256."""
    target, default_draft = pair
    kw.setdefault("max_model_len", 256)
    kw.setdefault("plain_under_load", False)  # every round speculates, unless a test is about load control
    return LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft or default_draft)), mode=mode,
               launch="local", **kw)


def ar_outputs(pair: tuple[Path, Path], prompts, params) -> list[list[int]]:
    """The target's tokens decoded alone (ar)."""
    with local_llm(pair, "ar") as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


class Alternate:
    """A chooser that alternates speculative and plain rounds (or always plain)."""

    def __init__(self, pattern=(True, False, False)):
        self.pattern, self.i = pattern, 0

    def speculate(self, batch):
        self.i += 1
        return self.pattern[self.i % len(self.pattern)]

    def observe(self, *args, **kwargs):
        pass

    def expects_plain(self, batch):
        """Plain where the pattern is always plain (the draft then prefills a sequence only when
        it first speculates)."""
        return not any(self.pattern)
