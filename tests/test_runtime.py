"""End-to-end runtime tests: real MPI ranks, real shared memory, tiny random-weight models."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from tiny_models import make_tiny_llama, make_tiny_pair
from trtssd import LLM, ModelRef, SamplingParams
from trtssd.processes import mapped_segments, open_files, start_time
from trtssd.sampling import processed_probs

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


def _llm(tiny, mode: str, **kw) -> LLM:
    target, draft = tiny
    kw.setdefault("max_seq_len", 256)
    # On these tiny models a plain target step costs less than an MPI round trip, so load
    # control would decode most rounds plainly; the tests are about the speculative paths.
    kw.setdefault("plain_under_load", False)
    return LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode=mode, **kw)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12, [3, 1, 4, 1, 5, 9, 2, 6], [42], [5, 6] * 5]


def _shm_segments() -> set[str]:
    """Our shared buffers and MPICH's own segments (every MPI process makes a mpich_shm_* in
    MPI_Init and removes it in MPI_Finalize, which a killed process never reaches)."""
    return {os.path.basename(p) for p in glob.glob("/dev/shm/trtssd-*") + glob.glob("/dev/shm/mpich_*")}


def _in_use_segments() -> set[str]:
    """Segments in use, not leaked: those other live processes map (other programs' while they
    run) and this process's own MPI segment (MPICH removes it in MPI_Finalize, at exit)."""
    own_mpi = mapped_segments(os.getpid(), ("mpich_",))
    return own_mpi.union(*(mapped_segments(pid, ("",)) for pid in psutil.pids() if pid != os.getpid()))


def _draft_segments(draft_pid: int) -> set[str]:
    """The draft rank's segments: our buffers and its MPICH segment (checked to exist)."""
    segments = mapped_segments(draft_pid, ("",)) & _shm_segments()
    assert any(n.startswith("trtssd-") for n in segments), segments  # the buffers are real shared memory
    assert any(n.startswith("mpich_shm_") for n in segments), segments  # the draft job's own MPI segment
    return segments


def _hydra_files() -> set[str]:
    """MPICH hydra's temporary topology files: mpiexec writes one per job, its proxy holds it
    open, and only a clean exit removes it."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "hydra_hwloc_xmlfile_*")))


def _open_hydra_files() -> set[str]:
    """Hydra files some live process (another job's mpiexec or proxy) still holds open."""
    return set().union(*(open_files(pid, ("hydra_hwloc_xmlfile_",)) for pid in psutil.pids()))


@pytest.fixture(autouse=True)
def no_leaked_shared_memory():
    """Every test leaves /dev/shm and the temporary directory as it found them: no buffer of
    ours, no segment or hydra file of MPICH's."""
    before, hydra_before = _shm_segments(), _hydra_files()
    yield
    leaked = _shm_segments() - before - _in_use_segments()
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"
    leaked_files = _hydra_files() - hydra_before - _open_hydra_files()
    assert not leaked_files, f"MPICH hydra files left behind: {sorted(leaked_files)}"


def _draft_job(draft_pid: int, target_pid: int | None = None) -> set[int]:
    """Every process of the draft's MPI job: the rank, its children and its ancestors below the
    target process (hydra_pmi_proxy, mpiexec); the target is this process unless given."""
    target_pid = target_pid or os.getpid()
    rank = psutil.Process(draft_pid)
    ancestors = [p.pid for p in rank.parents()]
    assert target_pid in ancestors, "the draft job is not a child of the target"
    job = {draft_pid, *ancestors[:ancestors.index(target_pid)], *(c.pid for c in rank.children(recursive=True))}
    assert len(job) >= 3, job  # at least mpiexec, hydra_pmi_proxy and the rank
    return job


def _running(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running or stopped (a zombie has ended: it only awaits its reaper)."""
    return {pid for pid in pids if start_time(pid) is not None}


def _kill(pids: set[int]) -> None:
    """Test cleanup: a failed check must not leave stopped processes on the machine."""
    for pid in _running(pids):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_sd_and_ssd_equal_ar(tiny, batch):
    params = SamplingParams(temperature=0, max_tokens=48)
    outputs = {}
    for mode in ("ar", "sd", "ssd"):
        with _llm(tiny, mode, max_batch=batch) as llm:
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
def test_greedy_ssd_equal_ar_with_each_backup(tiny, backup):
    params = SamplingParams(temperature=0, max_tokens=32)
    with _llm(tiny, "ar") as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
    with _llm(tiny, "ssd", backup=backup, max_batch=3) as llm:
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
             max_batch=32, max_seq_len=64) as llm:
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


def _ar_reference(tiny, params: SamplingParams) -> list[list[int]]:
    with _llm(tiny, "ar") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS[:4], params)]


def test_draft_killed_mid_generation_requests_complete_with_ar_output(tiny):
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = _ar_reference(tiny, params)
    with _llm(tiny, "ssd", max_batch=4, draft_timeout_s=10) as llm:
        engine = llm.loop
        job = _draft_job(engine.draft.pid)
        try:
            ids = _start_requests(engine, params)
            assert llm.draft_state == "alive"
            segments = _draft_segments(engine.draft.pid)
            os.kill(engine.draft.pid, signal.SIGKILL)
            got = _finish(engine, ids)
            assert llm.draft_state != "alive"
            assert llm.metrics.degraded_rounds > 0
            llm.close()
            assert not _running(job)  # mpiexec and hydra_pmi_proxy too
            assert not segments & _shm_segments()  # MPICH's segment too
        finally:
            _kill(job)
    assert got == ref


@pytest.mark.parametrize("stopped", ["rank", "job"])
def test_hung_draft_is_dropped_after_its_timeout(tiny, stopped):
    """SIGSTOP the draft rank alone, or its whole job (mpiexec, hydra_pmi_proxy, the rank and its
    children): the target gives up after draft_timeout_s, finishes in ar mode, and ends the whole
    job. Killing mpiexec alone is not enough: hydra starts the proxy and the rank in sessions of
    their own, and a stopped proxy never passes the kill on."""
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = _ar_reference(tiny, params)
    with _llm(tiny, "ssd", max_batch=4, draft_timeout_s=30) as llm:
        engine = llm.loop
        job = _draft_job(engine.draft.pid)
        try:
            ids = _start_requests(engine, params)
            assert llm.draft_state == "alive"
            segments = _draft_segments(engine.draft.pid)
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
            assert not _running(job)
            assert not segments & _shm_segments()  # MPICH's segment too
        finally:
            _kill(job)
    assert got == ref


def test_draft_error_mid_generation_requests_complete_with_ar_output(tiny):
    """An exception inside the draft rank (here: a message its loop does not know, which raises
    TypeError there) comes back as DraftError: the target degrades at once, without waiting for
    the timeout, and ends the draft's job."""
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = _ar_reference(tiny, params)
    with _llm(tiny, "ssd", max_batch=4, draft_timeout_s=30) as llm:
        engine = llm.loop
        job = _draft_job(engine.draft.pid)
        try:
            ids = _start_requests(engine, params)
            segments = _draft_segments(engine.draft.pid)
            assert engine.draft.send("not a protocol message")
            t0 = time.monotonic()
            got = _finish(engine, ids)
            assert time.monotonic() - t0 < 30  # reported, not timed out
            assert llm.draft_state != "alive"
            assert "draft rank error: TypeError" in engine.draft.failure, engine.draft.failure
            assert llm.metrics.degraded_rounds > 0
            llm.close()
            assert not _running(job)
            assert not segments & _shm_segments()  # MPICH's segment too
        finally:
            _kill(job)
    assert got == ref


def test_draft_that_fails_to_load_is_reported_at_once(tiny, tmp_path):
    """The draft rank's own error comes back as the reason LLM() fails, without waiting for the
    draft to time out; the buffers made for it are freed (checked by no_leaked_shared_memory)."""
    target, _ = tiny
    with pytest.raises(RuntimeError, match="draft rank did not start.*FileNotFoundError"):
        LLM(target=ModelRef(str(target)), draft=ModelRef(str(tmp_path)), mode="ssd", max_seq_len=256)


def test_draft_that_dies_before_connecting_is_reported_and_mpi_ends_cleanly(tiny, tmp_path):
    """A draft rank that exits before it connects (here its import fails) makes LLM() fail with
    that reason; the target's pending MPI accept is released, so the target's MPI still
    finalizes cleanly at exit (a thread left inside MPI_Comm_accept made it abort there)."""
    target, draft = tiny
    broken = tmp_path / "cwd" / "trtssd"  # ``python -m`` imports from the working directory first
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken install')\n")
    script = tmp_path / "target.py"
    script.write_text(
        "from trtssd import LLM, ModelRef\n"
        "try:\n"
        f"    LLM(target=ModelRef({str(target)!r}), draft=ModelRef({str(draft)!r}), mode='ssd', max_seq_len=128)\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
    )
    bindir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}", PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=broken.parent)
    assert "before connecting" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The target's own MPICH segment is gone with it: checked by no_leaked_shared_memory.


def test_killed_target_takes_its_draft_job_along(tiny, tmp_path):
    """A target killed before it could shut its draft down (SIGKILL: no close(), no atexit) must
    not leave the draft job waiting forever, nor its own or the draft's MPICH segment behind."""
    target, draft = tiny
    script = tmp_path / "target.py"
    script.write_text(
        "import signal\n"
        "from trtssd import LLM, ModelRef, SamplingParams\n"
        f"llm = LLM(target=ModelRef({str(target)!r}), draft=ModelRef({str(draft)!r}), mode='ssd', max_seq_len=128)\n"
        "llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))\n"
        "print(llm.loop.draft.pid, flush=True)\n"
        "signal.pause()  # until the test kills it\n"
    )
    bindir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}", PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    job: set[int] = set()
    try:
        draft_pid = int(proc.stdout.readline())
        job = _draft_job(draft_pid, proc.pid)
        segments = _draft_segments(draft_pid) | mapped_segments(proc.pid, ("mpich_",))
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while _running(job) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(job)
        assert not segments & _shm_segments()
    finally:
        proc.kill()
        proc.stdout.close()
        _kill(job)


def test_clean_shutdown_leaves_no_process_or_shared_memory(tiny):
    with _llm(tiny, "ssd") as llm:
        job = _draft_job(llm.loop.draft.pid)
        segments = _draft_segments(llm.loop.draft.pid)
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
    assert not _running(job)
    assert not segments & _shm_segments()


def test_stops_are_honoured_exactly(tiny):
    greedy = SamplingParams(temperature=0, max_tokens=30)
    with _llm(tiny, "ar") as llm:
        ref = llm.generate([PROMPTS[0]], greedy)[0].token_ids
    stop_tok = ref[10]
    first = ref.index(stop_tok)
    for mode in ("ar", "ssd"):
        with _llm(tiny, mode) as llm:
            out = llm.generate([PROMPTS[0]] * 2, [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]),
                                                  SamplingParams(temperature=0, max_tokens=7)])
        assert out[0].token_ids == ref[: first + 1] and out[0].finish_reason == "stop"
        assert out[1].token_ids == ref[:7] and out[1].finish_reason == "length"


def test_world_launch_under_mpiexec(tiny, tmp_path):
    """mpiexec -n 2: the last rank becomes the draft, buffers are an MPI-3 shared window."""
    target, draft = tiny
    script = tmp_path / "run.py"
    script.write_text(
        "import json, sys\n"
        "from trtssd import LLM, ModelRef, SamplingParams\n"
        "from trtssd.runtime.world import serve_world_rank\n"
        "if serve_world_rank(1):\n"
        "    sys.exit(0)\n"
        f"with LLM(target=ModelRef({str(target)!r}), draft=ModelRef({str(draft)!r}), mode='ssd', launch='world', max_seq_len=128, plain_under_load=False) as llm:\n"
        "    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=24))\n"
        "    print(json.dumps({'ids': out[0].token_ids, 'hits': llm.metrics.cache_hits}))\n"
    )
    bindir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}", PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.run([str(bindir / "mpiexec"), "-n", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    with _llm(tiny, "ar", max_seq_len=128) as llm:
        ref = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=24))[0].token_ids
    assert result["ids"] == ref
    assert result["hits"] > 0


def test_bad_options_are_rejected(tiny):
    with pytest.raises(ValueError, match="mode"):
        _llm(tiny, "fast")
    with pytest.raises(TypeError, match="unknown LLM option"):
        _llm(tiny, "ar", bogus=1)
    with pytest.raises(ValueError, match="fanout"):
        _llm(tiny, "ssd", k=5, fanout=(1, 2))  # K+1 = 6 entries wanted
    with pytest.raises(ValueError, match="fanout"):
        _llm(tiny, "ssd", fanout=(1,))
    with _llm(tiny, "ar") as llm:
        with pytest.raises(ValueError, match="prompt"):
            llm.generate([[]], SamplingParams())
        with pytest.raises(ValueError, match="max_seq_len"):
            llm.generate([[1] * 250], SamplingParams(max_tokens=100))
        with pytest.raises(ValueError, match=r"\[0, 64\)"):
            llm.generate([[1, 999]], SamplingParams())


def _cpu_s(pid: int) -> float:
    """Seconds process ``pid`` has run on a CPU, all its threads (nanosecond counters)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            total += int(Path(path).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the doorbell and /proc are Linux's")
def test_an_idle_draft_blocks_instead_of_polling(tiny):
    """Between requests (and through plain rounds, which borrow its cores) the draft rank waits
    on its doorbell: over 2 s idle it runs well under a millisecond and wakes a handful of times
    (polling, it woke ~200 times a second). A request after the idle spell is answered at once."""
    with _llm(tiny, "ssd", max_batch=2) as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([PROMPTS[0]], params)
        draft = psutil.Process(llm.loop.draft.pid)
        time.sleep(0.5)  # past the short spell of polls after the last message
        cpu0, switches0 = _cpu_s(draft.pid), draft.num_ctx_switches().voluntary
        time.sleep(2.0)
        cpu, switches = _cpu_s(draft.pid) - cpu0, draft.num_ctx_switches().voluntary - switches0
        t0 = time.perf_counter()
        out = llm.generate([PROMPTS[1]], params)[0]
        took = time.perf_counter() - t0
        summary = llm.metrics.summary()
    assert cpu < 0.003 and switches < 40, (cpu, switches)
    assert len(out.token_ids) == 8 and summary["degraded_rounds"] == 0 and took < 10
