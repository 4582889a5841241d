"""The target's side of the draft (trtssd/runtime/draft_client.py): a draft that fails, answers
another round, is killed, hangs, errs in its rank or never starts is a lost draft. The target
finishes every request in ar, with ar's output, says why, and ends the draft's job leaving no
process or shared memory behind. The first two with the draft worker in this process
(`LocalDraft`), the rest with a real draft rank over MPI (`DraftLink`)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from draft_jobs import (
    child_env, draft_job, draft_segments, kill_running, shm_segments, spawned_llm, still_running)
from local_llm import PROMPTS, ar_outputs, local_llm
from trtssd import LLM, ModelRef, SamplingParams


@pytest.mark.parametrize("where", ["answer", "prespeculate", "prefill"])
def test_a_failing_draft_degrades_to_ar_without_losing_a_request(tiny_pair, where):
    params = SamplingParams(temperature=0, max_tokens=30)
    ref = ar_outputs(tiny_pair, PROMPTS[:3], params)
    with local_llm(tiny_pair, "ssd", max_batch=2) as llm:
        worker = llm.loop.draft.server.worker
        original = getattr(worker, where)
        calls = []

        def failing(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected draft failure")
            return original(*args)

        setattr(worker, where, failing)
        got = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
        assert llm.draft_state != "alive"
        assert llm.metrics.degraded_rounds > 0
    assert got == ref


def test_a_reply_to_another_round_is_a_lost_draft(tiny_pair):
    params = SamplingParams(temperature=0, max_tokens=20)
    ref = ar_outputs(tiny_pair, PROMPTS[:1], params)[0]
    with local_llm(tiny_pair, "ssd") as llm:
        draft = llm.loop.draft
        original = draft.speculate

        def stale(req):
            reply, tokens, probs = original(req)
            return dataclasses.replace(reply, round_id=reply.round_id + (req.round_id == 2)), tokens, probs

        draft.speculate = stale
        got = llm.generate(PROMPTS[:1], params)[0].token_ids
        assert llm.draft_state != "alive" and llm.metrics.degraded_rounds > 0
    assert got == ref


def _start_requests(engine, params: SamplingParams) -> list[int]:
    """Four requests, three steps in: speculating, with most tokens still to come."""
    seqs = [engine.new_sequence(p, params) for p in PROMPTS[:4]]
    for seq in seqs:
        engine.add(seq)
    for _ in range(3):
        engine.step()
    return [seq.seq_id for seq in seqs]


def _finish(engine, ids: list[int]) -> list[list[int]]:
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i).output for i in ids]


def _ar_reference(tiny_pair, params: SamplingParams) -> list[list[int]]:
    with spawned_llm(tiny_pair, "ar") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS[:4], params)]


@pytest.mark.mpi
@pytest.mark.usefixtures("no_leaked_shared_memory")
def test_draft_killed_mid_generation_requests_complete_with_ar_output(tiny_pair):
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = _ar_reference(tiny_pair, params)
    with spawned_llm(tiny_pair, "ssd", max_batch=4, draft_timeout_s=10) as llm:
        engine = llm.loop
        job = draft_job(engine.draft.pid)
        try:
            ids = _start_requests(engine, params)
            assert llm.draft_state == "alive"
            segments = draft_segments(engine.draft.pid)
            os.kill(engine.draft.pid, signal.SIGKILL)
            got = _finish(engine, ids)
            assert llm.draft_state != "alive"
            assert llm.metrics.degraded_rounds > 0
            llm.close()
            assert not still_running(job)  # mpiexec and hydra_pmi_proxy too
            assert not segments & shm_segments()  # MPICH's segment too
        finally:
            kill_running(job)
    assert got == ref


@pytest.mark.mpi
@pytest.mark.usefixtures("no_leaked_shared_memory")
@pytest.mark.parametrize("stopped", ["rank", "job"])
def test_hung_draft_is_dropped_after_its_timeout(tiny_pair, stopped):
    """SIGSTOP the draft rank alone, or its whole job (mpiexec, hydra_pmi_proxy, the rank and its
    children): the target gives up after draft_timeout_s, finishes in ar mode, and ends the whole
    job. Killing mpiexec alone is not enough: hydra starts the proxy and the rank in sessions of
    their own, and a stopped proxy never passes the kill on."""
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = _ar_reference(tiny_pair, params)
    with spawned_llm(tiny_pair, "ssd", max_batch=4, draft_timeout_s=30) as llm:
        engine = llm.loop
        job = draft_job(engine.draft.pid)
        try:
            ids = _start_requests(engine, params)
            assert llm.draft_state == "alive"
            segments = draft_segments(engine.draft.pid)
            # Short only now: on a busy 2-core machine a live draft's first answers can take seconds.
            timeout_s = engine.draft.timeout_s = 2.0
            for pid in sorted(job) if stopped == "job" else [engine.draft.pid]:
                os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            got = _finish(engine, ids)
            assert time.monotonic() - t0 >= timeout_s  # it waited for the draft, then gave up
            assert llm.draft_state != "alive" and "within" in engine.draft.failure, engine.draft.failure
            assert llm.metrics.degraded_rounds > 0
            t0 = time.monotonic()
            llm.close()
            assert time.monotonic() - t0 < 2.0
            assert not still_running(job)
            assert not segments & shm_segments()  # MPICH's segment too
        finally:
            kill_running(job)
    assert got == ref


@pytest.mark.mpi
@pytest.mark.usefixtures("no_leaked_shared_memory")
def test_draft_error_mid_generation_requests_complete_with_ar_output(tiny_pair):
    """An exception inside the draft rank (here: a message its loop does not know, which raises
    TypeError there) comes back as DraftError: the target degrades at once, without waiting for
    the timeout, and ends the draft's job."""
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = _ar_reference(tiny_pair, params)
    with spawned_llm(tiny_pair, "ssd", max_batch=4, draft_timeout_s=30) as llm:
        engine = llm.loop
        job = draft_job(engine.draft.pid)
        try:
            ids = _start_requests(engine, params)
            segments = draft_segments(engine.draft.pid)
            assert engine.draft.send("not a protocol message")
            t0 = time.monotonic()
            got = _finish(engine, ids)
            assert time.monotonic() - t0 < 30  # reported, not timed out
            assert llm.draft_state != "alive"
            assert "draft rank error: TypeError" in engine.draft.failure, engine.draft.failure
            assert llm.metrics.degraded_rounds > 0
            llm.close()
            assert not still_running(job)
            assert not segments & shm_segments()  # MPICH's segment too
        finally:
            kill_running(job)
    assert got == ref


@pytest.mark.mpi
@pytest.mark.usefixtures("no_leaked_shared_memory")
def test_draft_that_fails_to_load_is_reported_at_once(tiny_pair, tmp_path):
    """The draft rank's own error comes back as the reason LLM() fails, without waiting for the
    draft to time out; the buffers made for it are freed (checked by no_leaked_shared_memory)."""
    target, _ = tiny_pair
    with pytest.raises(RuntimeError, match="draft rank did not start.*FileNotFoundError"):
        LLM(target=ModelRef(str(target)), draft=ModelRef(str(tmp_path)), mode="ssd", max_model_len=256)


@pytest.mark.mpi
@pytest.mark.usefixtures("no_leaked_shared_memory")
def test_draft_that_dies_before_connecting_is_reported_and_mpi_ends_cleanly(tiny_pair, tmp_path):
    """A draft rank that exits before it connects (here its import fails) makes LLM() fail with
    that reason; the target's pending MPI accept is released, so the target's MPI still
    finalizes cleanly at exit (a thread left inside MPI_Comm_accept made it abort there)."""
    target, draft = tiny_pair
    broken = tmp_path / "cwd" / "trtssd"  # ``python -m`` imports from the working directory first
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken install')\n")
    script = tmp_path / "target.py"
    script.write_text(
        "from trtssd import LLM, ModelRef\n"
        "try:\n"
        f"    LLM(target=ModelRef({str(target)!r}), draft=ModelRef({str(draft)!r}), mode='ssd', max_model_len=128)\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
    )
    env = child_env()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=broken.parent)
    assert "before connecting" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The target's own MPICH segment is gone with it: checked by no_leaked_shared_memory.
