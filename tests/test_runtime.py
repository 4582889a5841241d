"""End-to-end runtime tests: real MPI ranks, real shared memory, tiny random-weight models."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny_models import make_tiny_llama
from trtssd import LLM, ModelRef, SamplingParams
from trtssd.sampling import processed_probs

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_llama(root / "target", seed=0)
    draft = make_tiny_llama(root / "draft", seed=1, base=target, noise=0.05)
    return target, draft


def _llm(tiny, mode: str, **kw) -> LLM:
    target, draft = tiny
    kw.setdefault("max_seq_len", 256)
    return LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode=mode, **kw)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12, [3, 1, 4, 1, 5, 9, 2, 6], [42], [5, 6] * 5]


def _shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/trtssd-*"))


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
    distribution of plain sampling. Vocabulary 16 so that a 0.01 bias is ~4 sigma at 8000 samples."""
    root = tmp_path_factory.mktemp("tiny16")
    target = make_tiny_llama(root / "t", seed=3, vocab=16)
    draft = make_tiny_llama(root / "d", seed=4, vocab=16, base=target, noise=0.3)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3)
    prompt = [1, 2, 3]
    p2, p3 = _exact_marginals(target, prompt, params)
    n = 8000
    with LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode=mode, backup=backup, k=3,
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


def test_draft_killed_mid_generation_requests_complete_with_ar_output(tiny):
    params = SamplingParams(temperature=0, max_tokens=40)
    with _llm(tiny, "ar") as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS[:4], params)]
    before = _shm_segments()
    with _llm(tiny, "ssd", max_batch=4, draft_timeout_s=10) as llm:
        engine = llm.loop
        ids = [engine.add_request(p, params) for p in PROMPTS[:4]]
        for _ in range(3):
            engine.step()
        assert llm.draft_alive
        os.kill(engine.draft.pid, signal.SIGKILL)
        while engine.has_unfinished():
            engine.step()
        got = [engine.pop_finished(i).output for i in ids]
        assert not llm.draft_alive
        assert llm.metrics.degraded_rounds > 0
    assert got == ref
    assert _shm_segments() == before  # nothing leaked


def test_clean_shutdown_leaves_no_process_or_shared_memory(tiny):
    before = _shm_segments()
    with _llm(tiny, "ssd") as llm:
        pid = llm.loop.draft.pid
        assert _shm_segments() - before  # the buffers are real shared memory
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
    assert _shm_segments() == before
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


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
        "from mpi4py import MPI\n"
        "w = MPI.COMM_WORLD\n"
        "if w.Get_rank() == w.Get_size() - 1:\n"
        "    from trtssd.runtime.draft_rank import serve\n"
        "    serve(w); sys.exit(0)\n"
        f"with LLM(target=ModelRef({str(target)!r}), draft=ModelRef({str(draft)!r}), mode='ssd', launch='world', max_seq_len=128) as llm:\n"
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
        _llm(tiny, "ssd", fanout=(1, 2))
    with _llm(tiny, "ar") as llm:
        with pytest.raises(ValueError, match="prompt"):
            llm.generate([[]], SamplingParams())
        with pytest.raises(ValueError, match="max_seq_len"):
            llm.generate([[1] * 250], SamplingParams(max_tokens=100))
        with pytest.raises(ValueError, match=r"\[0, 64\)"):
            llm.generate([[1, 999]], SamplingParams())
