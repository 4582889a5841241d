"""End-to-end runtime tests: real MPI ranks, real shared memory, tiny random-weight models. A
lost draft's tests (killed, hung, failing, never started) are in test_draft_client.py."""

from __future__ import annotations

import glob
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from draft_jobs import (
    BINDIR, child_env, draft_job, draft_segments, kill_running, shm_segments, spawned_llm, still_running)
from local_llm import PROMPTS
from tiny_models import make_tiny_llama
from trtssd import LLM, ModelRef, SamplingParams
from trtssd.processes import mapped_segments
from trtssd.sampling import processed_probs

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("no_leaked_shared_memory")]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_sd_and_ssd_equal_ar(tiny_pair, batch):
    params = SamplingParams(temperature=0, max_tokens=48)
    outputs = {}
    for mode in ("ar", "sd", "ssd"):
        with spawned_llm(tiny_pair, mode, max_batch=batch) as llm:
            outputs[mode] = [o.token_ids for o in llm.generate(PROMPTS, params)]
            summary = llm.metrics.summary()
        assert summary["degraded_rounds"] == 0, summary
        if mode == "ssd":
            assert summary["cache_hits"] > 0, summary  # the cache path was exercised
            assert llm.loop.draft.step_s, "the draft's calibration did not reach the target (Ready)"
    assert outputs["sd"] == outputs["ar"]
    assert outputs["ssd"] == outputs["ar"]
    assert all(len(o) == 48 for o in outputs["ar"])


@pytest.mark.parametrize("backup", ["neural", "fast"])
def test_greedy_ssd_equal_ar_with_each_backup(tiny_pair, backup):
    params = SamplingParams(temperature=0, max_tokens=32)
    with spawned_llm(tiny_pair, "ar") as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
    with spawned_llm(tiny_pair, "ssd", backup=backup, max_batch=3) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
        summary = llm.metrics.summary()
    assert got == ref
    assert summary[f"{backup}_backups"] > 0 and summary["degraded_rounds"] == 0


def _exact_marginals(target_dir: Path, prompt: list[int], params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """P(token 2) and P(token 3) of plain sampling, by enumeration with transformers' model."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        def dist(prefixes: list[list[int]]) -> torch.Tensor:
            logits = model(torch.tensor(prefixes)).logits[:, -1, :]
            return processed_probs(logits, [params] * len(prefixes)).double()

        vocab = model.config.vocab_size
        p1 = dist([prompt])[0]
        p2_given_1 = dist([prompt + [a] for a in range(vocab)])  # [V, V]
        p2 = p1 @ p2_given_1
        pairs = [prompt + [a, b] for a in range(vocab) for b in range(vocab)]
        p3_given_12 = torch.cat([dist(pairs[i : i + 1024]) for i in range(0, len(pairs), 1024)]).view(vocab, vocab, vocab)
        joint12 = p1[:, None] * p2_given_1
        p3 = torch.einsum("ab,abc->c", joint12, p3_given_12)
    return p2.numpy(), p3.numpy()


def _assert_matches(counts: np.ndarray, probs: np.ndarray, label: str) -> None:
    """Every token's frequency within 4.5 sigma of its exact probability."""
    n = counts.sum()
    freq = counts / n
    sigma = np.sqrt(np.maximum(probs * (1 - probs), 1e-12) / n)
    z = np.abs(freq - probs) / sigma
    worst = int(z.argmax())
    assert z.max() < 4.5, f"{label}: token {worst} freq {freq[worst]:.4f} vs p {probs[worst]:.4f} (z={z.max():.1f})"


@pytest.mark.slow
@pytest.mark.parametrize("mode,backup", [("ssd", "neural"), ("ssd", "fast"), ("sd", "auto")])
def test_sampled_distribution_matches_ar(tmp_path_factory, mode, backup):
    """T=0.8, top-p 0.9 over many seeds: tokens 2 and 3 (both produced by verification) have the
    distribution of plain sampling, through the real ranks, buffers and messages. Vocabulary 16;
    at 5000 samples a shift of 0.03 in any token's frequency is >= 4.5 sigma (0.015 for a token of
    probability <= 0.05). Subtler biases of the verification itself are the business of
    test_exactness.py's 150k-row checks; a plumbing fault here (a stale or misrouted q' row)
    shifts tokens by far more."""
    root = tmp_path_factory.mktemp("tiny16")
    target = make_tiny_llama(root / "t", seed=3, vocab=16)
    draft = make_tiny_llama(root / "d", seed=4, vocab=16, base=target, noise=0.3)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3)
    prompt = [1, 2, 3]
    p2, p3 = _exact_marginals(target, prompt, params)
    n = 5000
    with LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode=mode, backup=backup, k=3,
             plain_under_load=False,
             max_batch=32, max_model_len=64) as llm:
        outs = llm.generate([prompt] * n, [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, seed=s)
                                           for s in range(n)])
        summary = llm.metrics.summary()
    assert summary["degraded_rounds"] == 0, summary  # every token went through verification
    assert summary["num_drafts"] >= n, summary
    tokens = np.array([o.token_ids for o in outs])
    _assert_matches(np.bincount(tokens[:, 1], minlength=16), p2, f"{mode}/{backup} token 2")
    _assert_matches(np.bincount(tokens[:, 2], minlength=16), p3, f"{mode}/{backup} token 3")
    if mode == "ssd":
        assert summary["cache_hits"] > 0 and summary["cache_misses"] > 0, summary
        assert summary[f"{backup}_backups"] > 0, summary


def test_killed_target_takes_its_draft_job_along(tiny_pair, tmp_path):
    """A target killed before it could shut its draft down (SIGKILL: no close(), no atexit) must
    not leave the draft job waiting forever, nor its own or the draft's MPICH segment behind."""
    target, draft = tiny_pair
    script = tmp_path / "target.py"
    script.write_text(
        "import signal\n"
        "from trtssd import LLM, ModelRef, SamplingParams\n"
        f"llm = LLM(target=ModelRef({str(target)!r}), draft=ModelRef({str(draft)!r}), mode='ssd', max_model_len=128)\n"
        "llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))\n"
        "print(llm.loop.draft.pid, flush=True)\n"
        "signal.pause()  # until the test kills it\n"
    )
    env = child_env()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    job: set[int] = set()
    try:
        draft_pid = int(proc.stdout.readline())
        job = draft_job(draft_pid, proc.pid)
        segments = draft_segments(draft_pid) | mapped_segments(proc.pid, ("mpich_",))
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while still_running(job) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not still_running(job)
        assert not segments & shm_segments()
    finally:
        proc.kill()
        proc.stdout.close()
        kill_running(job)


def test_clean_shutdown_leaves_no_process_or_shared_memory(tiny_pair):
    with spawned_llm(tiny_pair, "ssd") as llm:
        job = draft_job(llm.loop.draft.pid)
        segments = draft_segments(llm.loop.draft.pid)
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
    assert not still_running(job)
    assert not segments & shm_segments()


def test_stops_are_honoured_exactly(tiny_pair):
    greedy = SamplingParams(temperature=0, max_tokens=30)
    with spawned_llm(tiny_pair, "ar") as llm:
        ref = llm.generate([PROMPTS[0]], greedy)[0].token_ids
    stop_tok = ref[10]
    first = ref.index(stop_tok)
    for mode in ("ar", "ssd"):
        with spawned_llm(tiny_pair, mode) as llm:
            out = llm.generate([PROMPTS[0]] * 2, [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]),
                                                  SamplingParams(temperature=0, max_tokens=7)])
        assert out[0].token_ids == ref[: first + 1] and out[0].finish_reason == "stop"
        assert out[1].token_ids == ref[:7] and out[1].finish_reason == "length"


def test_world_launch_under_mpiexec(tiny_pair, tmp_path):
    """mpiexec -n 2: the last rank becomes the draft, buffers are an MPI-3 shared window."""
    target, draft = tiny_pair
    script = tmp_path / "run.py"
    script.write_text(
        "import json, sys\n"
        "from trtssd import LLM, ModelRef, SamplingParams\n"
        "from trtssd.runtime.world import serve_world_rank\n"
        "if serve_world_rank(1):\n"
        "    sys.exit(0)\n"
        f"with LLM(target=ModelRef({str(target)!r}), draft=ModelRef({str(draft)!r}), mode='ssd', launch='world', max_model_len=128, plain_under_load=False) as llm:\n"
        "    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=24))\n"
        "    print(json.dumps({'ids': out[0].token_ids, 'hits': llm.metrics.cache_hits}))\n"
    )
    env = child_env()
    proc = subprocess.run([str(BINDIR / "mpiexec"), "-n", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    with spawned_llm(tiny_pair, "ar", max_model_len=128) as llm:
        ref = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=24))[0].token_ids
    assert result["ids"] == ref
    assert result["hits"] > 0


def test_bad_options_are_rejected(tiny_pair):
    with pytest.raises(ValueError, match="mode"):
        spawned_llm(tiny_pair, "fast")
    with pytest.raises(TypeError, match="unknown LLM option"):
        spawned_llm(tiny_pair, "ar", bogus=1)
    with pytest.raises(ValueError, match="fanout"):
        spawned_llm(tiny_pair, "ssd", k=5, fanout=(1, 2))  # K+1 = 6 entries wanted
    with pytest.raises(ValueError, match="fanout"):
        spawned_llm(tiny_pair, "ssd", fanout=(1,))
    with spawned_llm(tiny_pair, "ar") as llm:
        with pytest.raises(ValueError, match="prompt"):
            llm.generate([[]], SamplingParams())
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([[1] * 250], SamplingParams(max_tokens=100))
        with pytest.raises(ValueError, match=r"\[0, 64\)"):
            llm.generate([[1, 999]], SamplingParams())


def _settle(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until process ``pid`` ran under 0.2 ms in 0.25 s: on a busy machine the draft's work
    after its last message (and its short spell of polls) may outlast any fixed pause. A rank that
    polls never settles: the wait then ends at ``timeout_s`` and the measurement that follows
    shows the polling."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = _cpu(pid)[0]
        time.sleep(0.25)
        if _cpu(pid)[0] - before < 0.0002:
            return


def _cpu(pid: int) -> tuple[float, int]:
    """Seconds process ``pid`` has run on a CPU and the times it was put on one (each wake-up),
    all its threads (the kernel's schedstat counters)."""
    seconds, slices = 0, 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            ran, _, times = Path(path).read_text().split()[:3]
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        seconds, slices = seconds + int(ran), slices + int(times)
    return seconds / 1e9, slices


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the doorbell and /proc are Linux's")
def test_an_idle_draft_blocks_instead_of_polling(tiny_pair):
    """Between requests (and through plain rounds, which borrow its cores) the draft rank waits
    on its doorbell: over 2 s idle it wakes about once a second (to see that the target lives),
    where polling woke it ~200 times a second, and runs under 1% of a core (a wake-up after a
    second asleep costs this VM 1-6 ms, most of it MPICH's first probe touching memory gone cold).
    A request after the idle spell is answered at once."""
    with spawned_llm(tiny_pair, "ssd", max_batch=2) as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([PROMPTS[0]], params)
        draft = psutil.Process(llm.loop.draft.pid)
        _settle(draft.pid)  # past the short spell of polls and the work after the last message
        cpu0, wakes0 = _cpu(draft.pid)
        time.sleep(2.0)
        cpu1, wakes1 = _cpu(draft.pid)
        cpu, wakes = cpu1 - cpu0, wakes1 - wakes0
        t0 = time.perf_counter()
        out = llm.generate([PROMPTS[1]], params)[0]
        took = time.perf_counter() - t0
        summary = llm.metrics.summary()
    assert wakes <= 10 and cpu < 0.02, (wakes, cpu)
    assert len(out.token_ids) == 8 and summary["degraded_rounds"] == 0 and took < 10
