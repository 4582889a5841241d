"""Requests arriving one after another beside running ones, stepped through a target loop by
hand: how tests check prompt pieces carried in plain rounds (`TargetLoop._carries`) against each
request decoded alone."""

from __future__ import annotations

from trtssd import SamplingParams
from trtssd.runtime.sequence import Sequence
from trtssd.runtime.target_loop import TargetLoop


def arriving(loop: TargetLoop, prompts: list[list[int]], params: SamplingParams,
             every: int | None) -> tuple[list[Sequence], int]:
    """Run ``prompts`` on ``loop``: the next one added ``every`` steps after the one before (None:
    each once the one before has finished, so each runs alone). Returns the finished sequences, in
    prompt order, and how many rounds carried prompt pieces in their forward."""
    carried = []
    plain, verify = loop.verifier.plain, loop.verifier.verify

    def counted(call):
        def run(*args, prompts=()):
            carried.append(bool(prompts))
            return call(*args, prompts=prompts)
        return run

    loop.verifier.plain, loop.verifier.verify = counted(plain), counted(verify)
    try:
        seqs, pending, steps = [], list(prompts), 0
        while pending or loop.has_unfinished():
            due = not loop.has_unfinished() if every is None else steps % every == 0
            if pending and due:
                seqs.append(loop.new_sequence(pending.pop(0), params))
                loop.add(seqs[-1])
            loop.step()
            steps += 1
    finally:
        del loop.verifier.plain, loop.verifier.verify
    return seqs, sum(carried)
