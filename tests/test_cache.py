"""The speculation cache of one sequence: tree branches -> entries keyed by outcome (k, bonus)."""

from __future__ import annotations

import pytest
import torch

from trtssd.spec_decode.cache import pre_speculation
from trtssd.spec_decode.tree import TreeLayout

K, V = 3, 7


def _layout(forks):
    depth = torch.tensor([j for j, _ in forks], dtype=torch.long)
    token = torch.tensor([c for _, c in forks], dtype=torch.long)
    return TreeLayout(seq_id=4, committed=10, k=K, fork_depth=depth, fork_token=token)


def test_each_branch_is_found_under_its_fork_and_nothing_else():
    forks = [(0, 5), (0, 2), (3, 6)]
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6], [0, 0, 1]])
    probs = torch.softmax(torch.randn(3, K, V), -1)
    logits = tuple(torch.randn(3, V) for _ in range(K))
    pre = pre_speculation((2, 0, 0, 1), _layout(forks), logits, tokens, probs)
    for branch, (j, c) in enumerate(forks):
        found = pre.lookup(j, c)
        assert found.branch == branch
        assert found.tokens.tolist() == tokens[branch].tolist()
        assert torch.equal(found.probs, probs[branch])
    assert pre.lookup(1, 5) is None and pre.lookup(0, 6) is None and pre.lookup(3, 5) is None
    assert [pre.forks_at(j) for j in range(K + 2)] == [2, 0, 0, 1, 0]


def test_greedy_branches_carry_no_rows():
    pre = pre_speculation((1, 0, 0, 0), _layout([(0, 3)]), (torch.zeros(1, V),) * K, torch.tensor([[1, 1, 1]]), None)
    assert pre.lookup(0, 3).probs is None


def test_duplicate_forks_and_bad_shapes_are_rejected():
    logits = (torch.zeros(2, V),) * K
    with pytest.raises(ValueError, match="duplicate"):
        pre_speculation((2, 0, 0, 0), _layout([(0, 3), (0, 3)]), logits, torch.zeros(2, K, dtype=torch.long), None)
    with pytest.raises(ValueError, match="tokens must be"):
        pre_speculation((2, 0, 0, 0), _layout([(0, 3), (0, 4)]), logits, torch.zeros(3, K, dtype=torch.long), None)
    with pytest.raises(ValueError, match="probs must be"):
        pre_speculation((2, 0, 0, 0), _layout([(0, 3), (0, 4)]), logits, torch.zeros(2, K, dtype=torch.long),
                        torch.zeros(2, K + 1, V))
