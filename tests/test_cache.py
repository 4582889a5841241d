"""The speculation cache: keys, batched lookup, per-round clearing and per-sequence eviction."""

from __future__ import annotations

import pytest
import torch

from trtssd.spec_decode.cache import LookupStats, SpeculationCache


def _populate(cache, seq_id, keys, k=3, vocab=5, with_probs=True):
    tokens = torch.arange(len(keys) * k).reshape(len(keys), k) + 100 * seq_id
    probs = torch.softmax(torch.randn(len(keys), k, vocab), -1) if with_probs else None
    cache.populate(seq_id, keys, tokens, probs)
    return tokens, probs


def test_populate_and_batched_lookup():
    cache = SpeculationCache()
    tokens, probs = _populate(cache, 7, [(0, 4), (0, 9), (2, 1)])
    _populate(cache, 8, [(0, 4)], with_probs=False)
    assert len(cache) == 4
    found = cache.lookup([(7, 0, 9), (7, 1, 9), (8, 0, 4), (9, 0, 4)])
    assert torch.equal(found[0].tokens, tokens[1]) and torch.equal(found[0].probs, probs[1])
    assert found[1] is None and found[3] is None
    assert found[2].probs is None  # point-mass speculation
    assert cache.last_lookup == LookupStats(hits=2, misses=2)
    cache.lookup([(7, 2, 1)])
    assert (cache.hits, cache.misses) == (3, 2) and cache.last_lookup == LookupStats(1, 0)
    cache.reset_stats()
    assert (cache.hits, cache.misses) == (0, 0)


def test_evict_and_clear():
    cache = SpeculationCache()
    _populate(cache, 1, [(0, 1), (1, 2)])
    _populate(cache, 2, [(0, 1)])
    cache.evict(1)
    cache.evict(1)  # idempotent
    assert len(cache) == 1 and cache.lookup([(1, 0, 1), (2, 0, 1)])[0] is None
    _populate(cache, 1, [(0, 1)])  # repopulating after eviction is fine
    cache.clear()
    assert len(cache) == 0 and cache.lookup([(2, 0, 1)]) == [None]


def test_stale_or_duplicate_keys_and_bad_shapes_are_rejected():
    cache = SpeculationCache()
    _populate(cache, 1, [(0, 1)])
    with pytest.raises(ValueError, match="already holds"):
        _populate(cache, 1, [(0, 1)])
    with pytest.raises(ValueError, match="duplicate"):
        _populate(cache, 2, [(0, 3), (0, 3)])
    with pytest.raises(ValueError, match="tokens"):
        cache.populate(3, [(0, 1)], torch.zeros(2, 3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="tokens"):
        cache.populate(3, [(0, 1)], torch.zeros(1, 3), None)
    with pytest.raises(ValueError, match="probs"):
        cache.populate(3, [(0, 1)], torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 2, 5))
    assert len(cache) == 1  # failed calls leave nothing behind
