"""Plain rounds borrow the draft's cores (trtssd.runtime.core_lending.CoreLending): the thread that
runs the forwards is pinned to both ranks' cores and the executor told the summed threads, and
speculative rounds give them back."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from trtssd.backends.base import ExecutorCapabilities
from trtssd.runtime.core_lending import core_lending


class _Executor:
    capabilities = ExecutorCapabilities(max_batch_tokens=64, lends_threads=True)

    def __init__(self):
        self.threads = []

    def set_threads(self, n: int, split_single_rows: bool = False) -> None:
        self.threads.append(n)


def _cores():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    return (cores[0],), (cores[-1],)


def test_plain_rounds_take_the_draft_cores_and_speculative_rounds_give_them_back():
    target, draft = _cores()
    before = os.sched_getaffinity(0)
    ex = _Executor()
    lending = core_lending(ex, target, 1, draft, 1)
    try:
        lending.for_round(plain=True)
        assert os.sched_getaffinity(0) == set(target) | set(draft) and ex.threads == [2]
        lending.for_round(plain=True)  # nothing changes: no call
        assert ex.threads == [2]
        lending.for_round(plain=False)
        assert os.sched_getaffinity(0) == set(target) and ex.threads == [2, 1]
        seen = {}

        def other_thread():  # a new engine thread applies the lending again, for itself
            lending.for_round(plain=False)
            seen["cores"] = os.sched_getaffinity(0)

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert seen["cores"] == set(target) and ex.threads == [2, 1, 1]
    finally:
        os.sched_setaffinity(0, before)


def test_no_lending_without_set_threads_or_draft_cores():
    target, draft = _cores()
    torch_like = SimpleNamespace(capabilities=ExecutorCapabilities(max_batch_tokens=64))
    assert core_lending(torch_like, target, 1, draft, 1) is None  # a torch executor does not lend
    assert core_lending(_Executor(), target, 1, None, 1) is None  # one core: nothing to borrow


def test_a_timing_run_on_its_own_thread_leaves_the_callers_cores_and_lending_alone():
    """Calibration's timed plain forwards run on a thread of their own (round_policy.calibrate_target):
    the constructing thread keeps its cores (llama.cpp's OpenMP workers start with their thread's
    cores), its errors come back, and the next round applies its cores again."""
    from trtssd.runtime.core_lending import on_own_thread

    target, draft = _cores()
    before = os.sched_getaffinity(0)
    ex = _Executor()
    lending = core_lending(ex, target, 1, draft, 1)

    def timing() -> set[int]:
        lending.for_round(plain=True)
        lending.for_round(plain=False)
        return os.sched_getaffinity(0)

    assert on_own_thread(timing) == set(target)
    assert os.sched_getaffinity(0) == before
    lending.forget_threads()
    lending.for_round(plain=False)
    try:
        assert ex.threads == [2, 1, 1]  # applied again, whatever id this thread shares
    finally:
        os.sched_setaffinity(0, before)
    with pytest.raises(ZeroDivisionError):
        on_own_thread(lambda: 1 / 0)
