"""Backup speculators and the per-round policy between them (docs/algorithm.md section 4)."""

from __future__ import annotations

from trtssd.spec_decode.backup import BackupCosts, prefer_neural
from trtssd.spec_decode.backup import ngram_proposal


def test_ngram_proposal_continues_the_latest_match():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 1, 2], 3) == [3, 7, 1]
    assert ngram_proposal([5], 2) == [5, 5]  # nothing to match: repeat, still a valid point mass


def test_batch_one_prefers_neural_large_batches_prefer_fast():
    costs = BackupCosts(verify_s=0.1, prespec_s=0.0, jit_s=0.1, tokens_neural=5.0, tokens_fast=1.1)
    assert prefer_neural(1, 1, 5.0, costs)
    assert not prefer_neural(8, 1, 5.0, costs)
    assert not prefer_neural(4, 0, 5.0, costs)  # nothing missed: nothing to back up


def test_a_long_prespeculation_makes_the_jit_relatively_cheaper():
    # The round lasts max(verify, pre-speculation): the same JIT delays a long round less.
    short = BackupCosts(verify_s=0.1, prespec_s=0.0, jit_s=0.15, tokens_neural=6.0, tokens_fast=1.0)
    long = BackupCosts(verify_s=0.1, prespec_s=0.3, jit_s=0.15, tokens_neural=6.0, tokens_fast=1.0)
    assert not prefer_neural(2, 1, 6.0, short)
    assert prefer_neural(2, 1, 6.0, long)
