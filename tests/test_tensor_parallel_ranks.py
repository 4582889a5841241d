"""A tensor-parallel target on real processes (trtssd/backends/tensor_parallel.py): rank 0 in this
process, its follower rank started by it, the draft its own MPI job (3 processes), tiny models.

- Greedy ar, sd and ssd at T = 2 give the same tokens, and the tokens of T = 1.
- Rank 0's executor mirrors every call: prefill, verification, a branch copied into the chain
  (copy_slots), released and reused rows, a shared prompt prefix and a forward every rank refuses
  all give the T = 1 logits within fp32 tolerance.
- Sampled ssd at T = 2 has the target's distribution (exact enumeration), and the same check
  rejects the draft's distribution: it would catch a verification that let the draft through.
- A killed follower ends the requests in flight with an error naming it (LLM and server), a
  killed draft degrades to ar on both target ranks, a killed rank 0 takes its follower along,
  and nothing is left behind: no process, no shared-memory segment.
- The option: checked by name before anything starts, on the command lines and in a Triton
  repository's model.json.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from tiny_models import make_tiny_llama, make_tiny_pair
from trtssd import LLM, ModelRef, SamplingParams
from trtssd.backends.base import Chunk, chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.config import RuntimeConfig
from trtssd.processes import mapped_segments, start_time
from trtssd.backends.tensor_parallel import TensorParallelLost, start_tensor_parallel_target
from trtssd.sampling import processed_probs

pytestmark = pytest.mark.mpi

TP = 2
ATOL = RTOL = 1e-4  # fp32: the all-reduce sums T partial products (tests/test_tensor_parallel.py)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12, [3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """4 heads over 2 KV heads: T = 2 splits it, T = 3 and 4 do not."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


def _llm(tiny, mode: str, tensor_parallel_size: int = TP, **kw) -> LLM:
    target, draft = tiny
    kw.setdefault("max_model_len", 128)
    kw.setdefault("plain_under_load", False)  # the tests are about the speculative paths
    return LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode=mode,
               tensor_parallel_size=tensor_parallel_size, **kw)


# --- nothing left behind -----------------------------------------------------------------------------


def _shm_segments() -> set[str]:
    return {os.path.basename(p) for p in glob.glob("/dev/shm/trtssd-*") + glob.glob("/dev/shm/mpich_*")}


def _in_use_segments() -> set[str]:
    """Segments live processes map (this process's own MPI segment among them)."""
    return set().union(*(mapped_segments(pid, ("",)) for pid in psutil.pids()))


@pytest.fixture(autouse=True)
def no_leaked_shared_memory():
    before = _shm_segments()
    yield
    leaked = _shm_segments() - before - _in_use_segments()
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"


def _running(pids) -> set[int]:
    return {pid for pid in pids if start_time(pid) is not None}


def _wait_ended(pids, timeout_s: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while _running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _running(pids)


def _children() -> set[int]:
    """Every process below this one, but multiprocessing's resource tracker (it lives as long as
    this process, whatever we start)."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())}


def _followers() -> list[int]:
    """The tensor-parallel followers this process started (rank 0 here: launch "spawn" or "local")."""
    return [p.pid for p in psutil.Process().children() if "trtssd.backends.tensor_parallel" in p.cmdline()]


def _kill(pids) -> None:
    for pid in _running(pids):
        os.kill(pid, signal.SIGKILL)


# --- greedy: ar == sd == ssd, and T = 2 == T = 1 ------------------------------------------------------


@pytest.fixture(scope="module")
def ar_tokens(tiny) -> dict[int, list[list[int]]]:
    """Greedy ar tokens at T = 1 and T = 2."""
    out = {}
    for size in (1, TP):
        with _llm(tiny, "ar", tensor_parallel_size=size, max_batch=4) as llm:
            out[size] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return out


def test_greedy_sd_and_ssd_equal_ar_at_two_target_ranks(tiny, ar_tokens):
    assert ar_tokens[TP] == ar_tokens[1]  # T = 2 decodes what T = 1 does
    for mode in ("sd", "ssd"):
        with _llm(tiny, mode, max_batch=4) as llm:
            assert len(_followers()) == TP - 1
            got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
            summary = llm.metrics.summary()
        assert summary["degraded_rounds"] == 0, summary
        if mode == "ssd":
            assert summary["cache_hits"] > 0, summary
        assert got == ar_tokens[TP], mode
    assert all(len(o) == GREEDY.max_tokens for o in ar_tokens[TP])


# --- logits: every mirrored call ---------------------------------------------------------------------


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _scenario(ex) -> dict[str, torch.Tensor]:
    """Forwards whose logits depend on every kind of call having reached every rank."""
    V = ex.vocab_size
    out = {}
    prompt = _tokens(11, 1, V)
    ex.add_sequence(0)
    out["prefill"] = ex.forward([chain_chunk(0, prompt, 0)])[0]
    ex.commit(0, len(prompt))
    out["verify"] = ex.forward([chain_chunk(0, _tokens(6, 2, V), len(prompt))])[0]
    ex.commit(0, 3)  # three accepted: slots 14..16 still hold the rejected tail
    c = ex.committed(0)
    # A branch written to scratch slots c+4, c+5, then copied into the chain at c, c+1 (as the
    # draft turns a hit's branch into its chain): a rank that missed the copy keeps the stale tail.
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 4] = mask[1, 4] = mask[1, 5] = True
    branch = Chunk(0, torch.tensor(_tokens(2, 3, V)), torch.tensor([c, c + 1]), torch.tensor([c + 4, c + 5]), mask)
    out["branch"] = ex.forward([branch])[0]
    ex.copy_slots(0, torch.tensor([c + 4, c + 5]), torch.tensor([c, c + 1]))
    ex.commit(0, 2)
    # A forward every rank refuses (a token id out of range) leaves the group as it was.
    with pytest.raises(ValueError, match="token ids"):
        ex.forward([chain_chunk(0, [V], ex.committed(0))])
    ex.add_sequence(1)
    second = _tokens(7, 4, V)
    after_copy, pre1 = ex.forward([chain_chunk(0, [5], ex.committed(0)),
                                   chain_chunk(1, second, 0, last_logits_only=True)])
    out.update(after_copy=after_copy, batched_prefill=pre1)
    ex.commit(0, 1)
    ex.release(0)
    ex.add_sequence(2)  # reuses row 0: with max_seqs 2 a rank that missed the release refuses it
    out["reused_row"] = ex.forward([chain_chunk(2, _tokens(9, 5, V), 0)])[0]
    ex.commit(2, 9)
    ex.release(1)
    ex.add_sequence(3)
    ex.share_prefix(2, 3, 6)  # the prefix cache's reuse: a rank that missed it holds row 1's old KV
    out["shared_prefix"] = ex.forward([chain_chunk(3, [7, 8], 6)])[0]
    ex.release(2)
    ex.release(3)
    return out


def test_mirrored_calls_give_the_logits_of_one_rank(tiny):
    target, _ = tiny
    options = {"max_seqs": 2, "max_seq_len": 64, "max_batch_tokens": None}
    ref = _scenario(TorchExecutor.from_pretrained(target, max_seqs=2, max_seq_len=64))
    ex = start_tensor_parallel_target(ModelRef(str(target)), RuntimeConfig(tensor_parallel_size=TP), **options)
    followers = _followers()
    try:
        got = _scenario(ex)
    finally:
        ex.close()
    assert not _wait_ended(followers, 10)  # close() ended them
    for key, want in ref.items():
        assert got[key].shape == want.shape, key
        diff = float((got[key] - want).abs().max())
        assert torch.allclose(got[key], want, atol=ATOL, rtol=RTOL), f"{key}: max |T=2 - T=1| = {diff:.3g}"


# --- sampled exactness at T = 2 -----------------------------------------------------------------------


def _exact_marginals(model_dir: Path, prompt: list[int], params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """P(token 2) and P(token 3) of plain sampling from ``model_dir``, by enumeration."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        def dist(prefixes: list[list[int]]) -> torch.Tensor:
            return processed_probs(model(torch.tensor(prefixes)).logits[:, -1, :], [params] * len(prefixes)).double()

        vocab = model.config.vocab_size
        p1 = dist([prompt])[0]
        p2_given_1 = dist([prompt + [a] for a in range(vocab)])
        pairs = [prompt + [a, b] for a in range(vocab) for b in range(vocab)]
        p3_given_12 = dist(pairs).view(vocab, vocab, vocab)
        p3 = torch.einsum("ab,abc->c", p1[:, None] * p2_given_1, p3_given_12)
    return (p1 @ p2_given_1).numpy(), p3.numpy()


def _worst_z(counts: np.ndarray, probs: np.ndarray) -> float:
    """The largest |frequency - p| of any token in binomial standard deviations."""
    n = counts.sum()
    sigma = np.sqrt(np.maximum(probs * (1 - probs), 1e-12) / n)
    return float((np.abs(counts / n - probs) / sigma).max())


def test_sampled_ssd_at_two_target_ranks_has_the_target_distribution(tmp_path_factory):
    """T = 0.8, top-p 0.9, one seed per request: tokens 2 and 3 (both from verification) within
    4.5 sigma of the target's exact marginals (a false alarm once in ~10^4 runs per token). At
    4000 samples a shift of 0.035 in a token's frequency is >= 4.5 sigma; the same counts sit far
    outside the draft's own marginals, so a verification that passed the draft's tokens through
    would fail here."""
    root = tmp_path_factory.mktemp("tiny16")
    target = make_tiny_llama(root / "t", seed=3, vocab=16)
    draft = make_tiny_llama(root / "d", seed=4, vocab=16, base=target, noise=0.3)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3)
    prompt, n = [1, 2, 3], 4000
    want = _exact_marginals(target, prompt, params)
    drafts = _exact_marginals(draft, prompt, params)
    with LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode="ssd", k=3, tensor_parallel_size=TP,
             plain_under_load=False, max_batch=32, max_model_len=64) as llm:
        outs = llm.generate([prompt] * n, [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, seed=s)
                                           for s in range(n)])
        summary = llm.metrics.summary()
    assert summary["degraded_rounds"] == 0 and summary["num_drafts"] >= n, summary
    assert summary["cache_hits"] > 0 and summary["cache_misses"] > 0, summary
    tokens = np.array([o.token_ids for o in outs])
    for position, (p, q) in enumerate(zip(want, drafts), start=2):
        counts = np.bincount(tokens[:, position - 1], minlength=16)
        assert _worst_z(counts, p) < 4.5, f"token {position}: z = {_worst_z(counts, p):.1f} against the target"
        assert _worst_z(counts, q) > 10, f"token {position}: the draft's marginals pass (z = {_worst_z(counts, q):.1f})"


# --- failures ---------------------------------------------------------------------------------------


def _start_requests(engine, params: SamplingParams) -> list[int]:
    seqs = [engine.new_sequence(p, params) for p in PROMPTS]
    for seq in seqs:
        engine.add(seq)
    for _ in range(3):
        engine.step()
    return [seq.seq_id for seq in seqs]


def test_killed_follower_ends_the_requests_with_an_error_and_leaves_nothing(tiny):
    params = SamplingParams(temperature=0, max_tokens=60)
    before = _children()
    llm = _llm(tiny, "ssd", max_batch=4)
    ours = _children() - before  # the follower, the draft's mpiexec, hydra proxy and rank
    try:
        engine = llm.loop
        (follower,) = _followers()
        assert follower in ours and engine.draft.pid in ours
        _start_requests(engine, params)
        assert engine.scheduler.running
        os.kill(follower, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelLost, match=rf"target rank 1 \(pid {follower}\) exited with code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 10  # noticed, not timed out
        with pytest.raises(TensorParallelLost, match="tensor_parallel_size=2"):  # and it stays refused
            llm.generate([[1, 2, 3]], GREEDY)
        llm.close()
        assert not _wait_ended(ours, 10), "a process of the LLM outlived close()"
    finally:
        llm.close()
        _kill(ours)


def test_killed_follower_fails_a_servers_open_streams(tiny):
    """The server's view (AsyncLLM): every open stream ends with the error, new requests are refused."""
    from trtssd.serving.async_llm import AsyncLLM, LoopStopped

    with _llm(tiny, "ssd", launch="local", max_batch=4) as llm:
        (follower,) = _followers()
        served = AsyncLLM(llm).start()

        async def main():
            streams = [served.submit(p, SamplingParams(temperature=0, max_tokens=90)) for p in PROMPTS]
            async for _ in streams[0]:
                os.kill(follower, signal.SIGKILL)  # at its first delta: every request is in flight
                break
            for stream in streams:
                with pytest.raises(LoopStopped, match="tensor-parallel target lost: target rank 1"):
                    await stream.result()
            with pytest.raises(LoopStopped, match="tensor-parallel target lost"):
                served.submit(PROMPTS[0], GREEDY)

        asyncio.run(main())
        served.shutdown()
    assert not _wait_ended({follower}, 5)


def test_killed_draft_degrades_to_ar_on_both_target_ranks(tiny, ar_tokens):
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens)
    before = _children()
    with _llm(tiny, "ssd", max_batch=4, draft_timeout_s=10) as llm:
        engine = llm.loop
        ours = _children() - before
        try:
            ids = _start_requests(engine, params)
            os.kill(engine.draft.pid, signal.SIGKILL)
            while engine.has_unfinished():
                engine.step()
            got = [engine.pop_finished(i).output for i in ids]
            assert llm.draft_state != "alive" and llm.metrics.degraded_rounds > 0
            assert _running(_followers())  # the target group went on
        finally:
            llm.close()
            left = _wait_ended(ours, 10)
            _kill(ours)
    assert not left
    assert got == ar_tokens[TP]


KILLED_LEADER_SCRIPT = """
import signal, sys
import psutil
from trtssd import LLM, ModelRef, SamplingParams
llm = LLM(target=ModelRef(sys.argv[1]), mode='ar', tensor_parallel_size=2, max_model_len=64)
llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
(follower,) = [p for p in psutil.Process().children() if 'trtssd.backends.tensor_parallel' in p.cmdline()]
print(follower.pid, flush=True)
signal.pause()
"""


def test_killed_rank_zero_takes_its_follower_along(tiny):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_LEADER_SCRIPT, str(tiny[0])], stdout=subprocess.PIPE,
                            text=True, env=env)
    follower = None
    try:
        follower = int(proc.stdout.readline())
        proc.kill()
        proc.wait()
        assert not _wait_ended({follower}, 30), "the follower outlived its rank 0"
    finally:
        proc.kill()
        proc.stdout.close()
        if follower is not None:
            _kill({follower})


# --- the option -------------------------------------------------------------------------------------


def test_sizes_and_backends_that_cannot_split_are_refused_before_anything_starts(tiny, tmp_path):
    before = _children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*allowed values: 1, 2$"):
        _llm(tiny, "ssd", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer; got 0"):
        _llm(tiny, "ar", tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be 1 for a target on the 'ggml' backend"):
        LLM(target=ModelRef(str(tmp_path / "m.gguf"), backend="ggml"), mode="ar", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"trtllm_engine_dir: no tp_size readable from .*config.json"):
        _llm(tiny, "ssd", verifier="trtllm", trtllm_engine_dir=str(tmp_path))
    assert _children() == before  # nothing was started


def test_ranks_that_fail_to_load_are_reported_and_ended(tiny, tmp_path):
    """Weights that cannot be read (a truncated safetensors file) fail every rank's load: LLM()
    raises with each rank's reason, and the follower it started is gone."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny[0], broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    before = _children()
    with pytest.raises(RuntimeError, match=r"tensor-parallel target did not start: rank 0: .*; rank 1: "):
        LLM(target=ModelRef(str(broken)), mode="ar", tensor_parallel_size=TP, max_model_len=64)
    assert _children() == before  # the follower was ended (and reaped) before LLM() raised


def test_the_option_on_the_command_lines_and_in_a_triton_repository(tiny, tmp_path):
    from trtssd import cli
    from trtssd.bench import cli as bench_cli
    from trtssd.cli_options import engine_options
    from trtssd.triton.model_options import ModelOptions
    from trtssd.triton.repository import write_repository

    for words in (["generate"], ["serve"], ["triton-repo", "--out", "x"]):
        args = cli.build_parser().parse_args(words + ["--tensor-parallel-size", "2"])
        assert engine_options(args) == {"tensor_parallel_size": 2}
    assert bench_cli.build_parser().parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="argument --tensor-parallel-size: tensor_parallel_size must be a positive"):
        engine_options(cli.build_parser().parse_args(["generate", "--tensor-parallel-size", "0"]))
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "manifest.json").write_text("{}")
    repo = write_repository(tmp_path / "repo", str(engine), {"tensor_parallel_size": 2, "mode": "ssd"})
    options = ModelOptions.read(repo / "trtssd" / "1")
    assert options.llm["tensor_parallel_size"] == 2
    assert json.loads((repo / "trtssd" / "1" / "model.json").read_text())["llm"]["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        write_repository(tmp_path / "bad", str(engine), {"tensor_parallel_size": -1})


# --- GPUs: NCCL between two devices ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (rank r of the target on cuda:r, NCCL between them)")
def test_two_gpu_target_ranks_decode_as_one(tiny):
    """T = 2 on cuda:0 and cuda:1 (NCCL), the draft on cuda:0 in this process (no MPI needed on a
    GPU machine): greedy ar and ssd give the tokens of ar at T = 1 on cuda:0."""
    devices = {"target_device": "cuda:0", "draft_device": "cuda:0", "launch": "local", "max_batch": 4}
    with _llm(tiny, "ar", tensor_parallel_size=1, **devices) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    for mode in ("ar", "ssd"):
        with _llm(tiny, mode, **devices) as llm:
            assert str(llm.loop.target.device) == "cuda:0"
            got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
            summary = llm.metrics.summary()
        assert got == want, mode
        assert summary["degraded_rounds"] == 0, summary
