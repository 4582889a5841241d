"""Tensor parallelism of the torch target (trtssd/models/tensor_parallel.py,
trtssd/backends/tensor_parallel.py): a 2-way split over gloo gives the T=1 executor's logits for
prefill, K+1 verification and tree steps (next to another sequence's prefill), and the same greedy
decode token for token; a size that does not divide the model is refused by name.

Two worker processes (spawned, gloo over a file store) run one scenario per tiny model; the test
process runs the same scenario on a plain ``TorchExecutor`` and compares. Every wait is bounded:
the process group times out a hung collective after ``COLLECTIVE_TIMEOUT_S`` and the workers are
terminated (then killed) past ``DEADLINE_S``, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trtssd.backends.base import Chunk, chain_chunk, chunk_on_host
from trtssd.backends.tensor_parallel import load_tensor_parallel_executor, receive, send, tensor_parallel_executor
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.models.loader import load_state_dict
from trtssd.models.tensor_parallel import check_tensor_parallel, shard_config

log = logging.getLogger(__name__)

TP = 2
ATOL = RTOL = 1e-4
COLLECTIVE_TIMEOUT_S = 30
DEADLINE_S = 90
GREEDY_STEPS = 20
EXECUTOR = {"max_seqs": 3, "max_seq_len": 64}

# name -> (TINY_CONFIGS key or None for the MHA model below); kept in the test process only: the
# workers never import transformers.
MODELS = ("mha_llama", "llama3", "qwen2", "qwen3")


def _config(name: str):
    import transformers
    from tiny_models import TINY_CONFIGS

    if name == "mha_llama":
        # No GQA (KV heads = heads), biased q/k/v/o (o's bias must enter the all-reduce once), an
        # odd vocabulary (the head pads it to 2 x 49).
        return transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, attention_bias=True, tie_word_embeddings=False, max_position_embeddings=128,
        )
    return TINY_CONFIGS[name]()  # 4 heads over 2 KV heads (GQA); llama3 RoPE, tied Qwen2, Qwen3 q/k norm


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    import transformers
    from tiny_models import randomize

    dirs = {}
    for i, name in enumerate(MODELS):
        directory = tmp_path_factory.mktemp(name)
        model = transformers.AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32)
        randomize(model, seed=40 + i)
        model.save_pretrained(directory)
        dirs[name] = directory
    return dirs


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tree_chunk(seq_id: int, committed: int, glue_len: int, forks: list[int], depth: int, tokens: list[int]) -> Chunk:
    """Tree step ``depth``: branch i forks after glue token forks[i], sees the prefix, glue[0..fork]
    and its own earlier tree tokens (scratch slots after the glue: glue_len + d * B + i)."""
    B = len(forks)
    mask = torch.zeros(B, glue_len + (depth + 1) * B, dtype=torch.bool)
    for i, j in enumerate(forks):
        mask[i, : j + 1] = True
        for d in range(depth + 1):
            mask[i, glue_len + d * B + i] = True
    positions = torch.tensor([committed + j + 1 + depth for j in forks])
    slots = torch.tensor([committed + glue_len + depth * B + i for i in range(B)])
    return Chunk(seq_id, torch.tensor(tokens), positions, slots, mask)


def scenario(ex, share) -> dict[str, torch.Tensor]:
    """The forwards compared. ``share(chunks)`` returns the chunks every rank runs: rank 0's,
    broadcast (the identity at T=1). Every rank builds them; only rank 0's copy is used, as the
    target loop will do."""
    V = ex.vocab_size
    out: dict[str, torch.Tensor] = {}
    prompt, verify = _tokens(11, 1, V), _tokens(6, 2, V)
    n = len(prompt)
    ex.add_sequence(0)
    out["prefill"] = ex.forward(share([chain_chunk(0, prompt, 0)]))[0]  # every row
    ex.commit(0, n)
    out["verify"] = ex.forward(share([chain_chunk(0, verify, n)]))[0]  # K+1 = 6 tokens
    # Two tree steps over the first 3 verified tokens (left uncommitted as glue), each batched with
    # another sequence's work: a prefill, then a one-token decode.
    forks = [0, 0, 1, 2]
    ex.add_sequence(1)
    second = _tokens(7, 3, V)
    tree0, pre1 = ex.forward(share([_tree_chunk(0, n, 3, forks, 0, [11, 12, 13, 14]),
                                    chain_chunk(1, second, 0, last_logits_only=True)]))
    ex.commit(1, len(second))
    tree1, dec1 = ex.forward(share([_tree_chunk(0, n, 3, forks, 1, [21, 22, 23, 24]),
                                    chain_chunk(1, [5], len(second))]))
    out.update(tree0=tree0, tree1=tree1, batched_prefill=pre1, batched_decode=dec1)
    ex.release(0)
    ex.release(1)
    # Greedy decode: rank 0's argmax decides each next token.
    ex.add_sequence(2)
    prompt = _tokens(5, 4, V)
    logits = ex.forward(share([chain_chunk(2, prompt, 0, last_logits_only=True)]))[0]
    ex.commit(2, len(prompt))
    tokens, rows = [], [logits]
    for _ in range(GREEDY_STEPS):
        chunk = share([chain_chunk(2, [int(logits[-1].argmax())], ex.committed(2))])
        tokens.append(int(chunk[0].tokens[0]))
        logits = ex.forward(chunk)[0]
        ex.commit(2, 1)
        rows.append(logits)
    out["greedy_tokens"] = torch.tensor(tokens)
    out["greedy_logits"] = torch.cat(rows)
    return out


def _worker(rank: int, size: int, store: str, dirs: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        def share(chunks):  # rank 0's chunks on every rank, as the runtime sends a forward's
            if rank != 0:
                return receive(None)
            chunks = [chunk_on_host(c) for c in chunks]
            send(chunks, None)
            return chunks

        results = {name: scenario(load_tensor_parallel_executor(d, rank, size, **EXECUTOR), share)
                   for name, d in dirs.items()}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_workers(size: int, dirs: dict[str, Path], tmp: Path) -> list[dict]:
    """Start ``size`` ranks, wait for all (failing fast when one fails), never leave one behind."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, size, str(tmp / "store"), {k: str(v) for k, v in dirs.items()},
                                                str(tmp)), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank failed: the others would only wait for it in a collective
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * size, (f"tensor-parallel workers exited with {codes} "
                                 f"(negative: terminated, after another rank failed or past {DEADLINE_S} s)")
    assert not any(p.is_alive() for p in procs)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(size)]


@pytest.fixture(scope="module")
def results(model_dirs, tmp_path_factory):
    """(T=1 reference, [rank 0, rank 1]) scenario outputs per model."""
    ranks = _run_workers(TP, model_dirs, tmp_path_factory.mktemp("tp"))
    ref = {name: scenario(TorchExecutor.from_pretrained(d, **EXECUTOR), lambda chunks: chunks)
           for name, d in model_dirs.items()}
    return ref, ranks


@pytest.mark.parametrize("name", MODELS)
def test_split_logits_equal_unsplit(results, name):
    ref, ranks = results
    for key in ("prefill", "verify", "tree0", "tree1", "batched_prefill", "batched_decode", "greedy_logits"):
        want = ref[name][key]
        for rank, got in enumerate(ranks):
            got = got[name][key]
            assert got.shape == want.shape, (key, rank)
            diff = float((got - want).abs().max())
            log.info("%s %s rank %d: max |TP - T=1| = %.3g", name, key, rank, diff)
            assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), f"{name} {key} rank {rank}: max diff {diff:.3g}"
    # Every rank holds the same logits (one gather, one reduction result), so any rank may sample.
    for key in ref[name]:
        assert torch.equal(ranks[0][name][key], ranks[1][name][key]), key


@pytest.mark.parametrize("name", MODELS)
def test_split_greedy_decode_equals_unsplit(results, name):
    ref, ranks = results
    want = ref[name]["greedy_tokens"].tolist()
    assert len(want) == GREEDY_STEPS
    for rank in ranks:
        assert rank[name]["greedy_tokens"].tolist() == want


def test_one_way_split_is_the_plain_model(model_dirs):
    d = model_dirs["llama3"]
    cfg, state = load_state_dict(d)
    ours = scenario(tensor_parallel_executor(cfg, state, 0, 1, **EXECUTOR), lambda chunks: chunks)
    ref = scenario(TorchExecutor.from_pretrained(d, **EXECUTOR), lambda chunks: chunks)
    for key in ref:
        assert torch.equal(ours[key], ref[key]), key


def test_sizes_that_do_not_divide_are_refused(model_dirs):
    cfg, state = load_state_dict(model_dirs["llama3"])  # 4 heads, 2 KV heads, MLP 96
    for size in (3, 4):  # 3 divides no head count; 4 would need KV heads replicated
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={size} .*allowed values: 1, 2$"):
            check_tensor_parallel(cfg, size)
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            tensor_parallel_executor(cfg, state, 0, size, **EXECUTOR)
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            load_tensor_parallel_executor(model_dirs["llama3"], 0, size, **EXECUTOR)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        check_tensor_parallel(cfg, 0)
    mha, _ = load_state_dict(model_dirs["mha_llama"])
    check_tensor_parallel(mha, 4)  # 4 heads, 4 KV heads, MLP 96: 4 ranks of one head each
    local = shard_config(mha, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (1, 1, 24, 97)
    with pytest.raises(ValueError, match="process group"):  # no group initialized in this process
        tensor_parallel_executor(mha, load_state_dict(model_dirs["mha_llama"])[1], 0, 2, **EXECUTOR)
