"""Calibration (trtssd/runtime/calibration.py) is a step of its own, the launcher's: constructing
the ranks times nothing. The draft's start-up calibration is stored per machine and model and
reused at the next start."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tiny_models import make_tiny_llama
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.config import Mode, SpeculativeConfig
from trtssd.runtime import draft_worker as dw
from trtssd.runtime import calibration as sm
from trtssd.runtime.draft_worker import DraftWorker
from trtssd.runtime.round_policy import calibrate_target
from trtssd.runtime.target_loop import TargetLoop

K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("calibration") / "m", seed=4)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "calibration"
    monkeypatch.setenv(sm.CALIBRATION_CACHE_ENV, str(folder))
    return folder


@pytest.fixture
def timed(monkeypatch):
    """Count the timing calls the worker makes (each returns what the real one would)."""
    calls = []

    def counting(name):
        real = getattr(sm, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(dw, name, wrapper)

    counting("time_forwards")
    counting("time_tree_steps")
    return calls


def _worker(model_dir, k: int = K) -> DraftWorker:
    executor = TorchExecutor.from_pretrained(model_dir, max_seqs=2, max_seq_len=256)
    return DraftWorker(executor, SpeculativeConfig(mode=Mode.SSD, k=k, fanout="auto", fanout_budget=8))


def test_the_second_start_does_not_time_again(model_dir, cache, timed):
    first = _worker(model_dir)
    points = first.calibrate(context=16, max_rows=8)
    assert timed == ["time_forwards", "time_tree_steps"]
    [stored] = cache.glob("*.json")
    record = json.loads(stored.read_text())
    assert record["fields"]["k"] == K and record["fields"]["threads"] >= 1  # says what it was measured for
    second = _worker(model_dir)  # a new start: a fresh executor over the same model
    assert second.calibrate(context=16, max_rows=8) == points
    assert timed == ["time_forwards", "time_tree_steps"]  # nothing timed again
    assert second.tree_costs.curve().points == first.tree_costs.curve().points
    assert second.forward_costs.curve().points == first.forward_costs.curve().points


def test_another_k_model_or_thread_count_times_again(model_dir, cache, timed, tmp_path, monkeypatch):
    _worker(model_dir).calibrate(context=16, max_rows=8)
    _worker(model_dir, k=K + 1).calibrate(context=16, max_rows=8)
    other = make_tiny_llama(tmp_path / "wider", seed=4, hidden=64)
    _worker(other).calibrate(context=16, max_rows=8)
    monkeypatch.setattr(sm.torch, "get_num_threads", lambda: 97)
    _worker(model_dir).calibrate(context=16, max_rows=8)
    assert timed.count("time_forwards") == 4 and len(list(cache.glob("*.json"))) == 4


def test_deleting_the_cache_or_turning_it_off_times_again(model_dir, cache, timed, monkeypatch):
    _worker(model_dir).calibrate(context=16, max_rows=8)
    for path in cache.glob("*.json"):
        path.unlink()
    _worker(model_dir).calibrate(context=16, max_rows=8)
    monkeypatch.setenv(sm.CALIBRATION_CACHE_ENV, "off")
    _worker(model_dir).calibrate(context=16, max_rows=8)
    assert timed.count("time_forwards") == 3


def test_an_unreadable_calibration_is_timed_again_and_replaced(model_dir, cache, timed):
    _worker(model_dir).calibrate(context=16, max_rows=8)
    [stored] = cache.glob("*.json")
    stored.write_text("{not json")
    _worker(model_dir).calibrate(context=16, max_rows=8)
    assert timed.count("time_forwards") == 2
    assert set(json.loads(stored.read_text())) >= {"chain", "tree", "fields"}


def test_constructing_a_loop_or_a_draft_worker_times_nothing_and_writes_nothing(tiny_pair, tmp_path, monkeypatch):
    """Calibration is a step of its own, the launcher's (`round_policy.calibrate_target`,
    `DraftWorker.calibrate`): a TargetLoop and a DraftWorker constructed with every adaptive
    option on (load control with the draft's costs, K per round, prefix caching) run no forward
    and write no file; the calibration step then does both."""
    cache = tmp_path / "calibration"  # absent: a stored calibration would create it
    monkeypatch.setenv("TRTSSD_CALIBRATION_CACHE", str(cache))
    forwards = []
    executors = [TorchExecutor.from_pretrained(str(path), max_seqs=6, max_seq_len=256) for path in tiny_pair]
    for ex in executors:
        monkeypatch.setattr(ex, "forward", lambda chunks, run=ex.forward: forwards.append(len(chunks)) or run(chunks))
    spec = SpeculativeConfig(mode="ssd", plain_under_load=True, k_per_round=True)
    draft = SimpleNamespace(alive=True, pid=None, step_s={1: 0.01, 8: 0.05})  # the draft's calibrated forwards
    TargetLoop(executors[0], spec, max_batch=4, max_model_len=200, draft=draft, prefix_cache_seqs=2)
    DraftWorker(executors[1], spec, prefix_cache_seqs=2)
    assert not forwards and not cache.exists()
    costs = calibrate_target(executors[0], spec, 4, draft.step_s, lending=None)
    assert forwards and costs.forwards and costs.plain and len(list(cache.iterdir())) == 1
