"""TorchExecutor semantics against transformers' full-sequence logits: decode, K+1 verification,
tree branches (logical positions != slots), ragged batches, commit/discard, capacity and input
errors. Every reference row is transformers' logit for the same token history."""

from __future__ import annotations

import pytest
import torch

from tiny_models import TINY_CONFIGS, TOL, build_tiny, hf_logits
from trtssd.backends.base import CapacityError, Chunk, chain_chunk
from trtssd.backends.torch_backend import TorchExecutor

VOCAB = 96


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def setup(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = build_tiny(request.param, directory, seed=10)
    return hf, directory


def new_executor(directory, **kw) -> TorchExecutor:
    return TorchExecutor.from_pretrained(directory, **{"max_seqs": 3, "max_seq_len": 64, **kw})


def prefill(ex: TorchExecutor, seq_id: int, tokens: list[int]) -> None:
    ex.add_sequence(seq_id)
    ex.forward([chain_chunk(seq_id, tokens, 0, last_logits_only=True)])
    ex.commit(seq_id, len(tokens))


def close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    return ours.shape == ref.shape and bool((ours - ref).abs().max() < TOL)


def test_decode_and_verify_extension(setup):
    hf, directory = setup
    ex = new_executor(directory)
    prompt, more = rand_tokens(11, 1), rand_tokens(7, 2)
    ref = hf_logits(hf, prompt + more)
    prefill(ex, 0, prompt)
    # one-token decode step
    n = len(prompt)
    assert close(ex.forward([chain_chunk(0, more[:1], n)])[0], ref[n : n + 1])
    ex.commit(0, 1)
    # K+1 = 6 tokens verified in one pass
    assert close(ex.forward([chain_chunk(0, more[1:], n + 1)])[0], ref[n + 1 :])


def test_commit_keeps_accepted_and_discard_is_free(setup):
    hf, directory = setup
    ex = new_executor(directory)
    prompt, draft = rand_tokens(9, 3), rand_tokens(5, 4)
    prefill(ex, 0, prompt)
    n = len(prompt)
    ex.forward([chain_chunk(0, draft, n)])  # verify b, s1..s4
    ex.commit(0, 3)  # accept b, s1, s2: s3, s4 are discarded by not committing them
    assert ex.committed(0) == n + 3
    bonus = (draft[3] + 1) % VOCAB  # a different token lands in s3's old slot
    ours = ex.forward([chain_chunk(0, [bonus, 7], n + 3)])[0]
    assert close(ours, hf_logits(hf, prompt + draft[:3] + [bonus, 7])[n + 3 :])
    # Nothing committed: the same slots are simply rewritten next time.
    ours = ex.forward([chain_chunk(0, [5], n + 3)])[0]
    assert close(ours, hf_logits(hf, prompt + draft[:3] + [5])[n + 3 :])


def tree_chunk(seq_id, committed, glue_len, branches, depth, step_tokens):
    """Chunk for tree step ``depth``: branch i = (fork depth j, tokens so far) sees the prefix,
    glue[0..j] and its own tree tokens. Tree tokens of step d live in scratch slots after the
    glue: glue_len + d * B + i (relative), at logical position committed + j + 1 + d."""
    B = len(branches)
    R = glue_len + (depth + 1) * B
    mask = torch.zeros(B, R, dtype=torch.bool)
    positions, slots = [], []
    for i, (j, _) in enumerate(branches):
        mask[i, : j + 1] = True
        for d in range(depth + 1):
            mask[i, glue_len + d * B + i] = True
        positions.append(committed + j + 1 + depth)
        slots.append(committed + glue_len + depth * B + i)
    return Chunk(seq_id, torch.tensor(step_tokens), torch.tensor(positions), torch.tensor(slots), mask)


def test_tree_branches_equal_decoding_each_branch_alone(setup):
    hf, directory = setup
    ex = new_executor(directory)
    prompt, glue = rand_tokens(10, 5), rand_tokens(3, 6)  # glue = b, s1, s2 (K = 2)
    prefill(ex, 0, prompt)
    n = len(prompt)
    ex.forward([chain_chunk(0, glue, n)])  # glue decode: KV for b, s1, s2 (not committed)
    # forks: depth 0 (two candidates), depth 1, depth 2 (K: after all accepted)
    branches = [(0, [11]), (0, [12]), (1, [13]), (2, [14])]
    followups = [21, 22, 23, 24]
    for depth in range(2):
        step = [b[1][depth] for b in branches]
        ours = ex.forward([tree_chunk(0, n, len(glue), branches, depth, step)])[0]
        for i, (j, toks) in enumerate(branches):
            alone = prompt + glue[: j + 1] + toks[: depth + 1]
            assert close(ours[i : i + 1], hf_logits(hf, alone)[-1:]), (depth, i)
        for b, f in zip(branches, followups):
            b[1].append(f)
    assert ex.committed(0) == n  # tree decode commits nothing


def test_ragged_batch_mixes_prefill_decode_verify_and_tree(setup):
    hf, directory = setup
    ex = new_executor(directory)
    p0, p1 = rand_tokens(13, 7), rand_tokens(4, 8)
    # ragged prefill of two sequences in one pass (all rows returned)
    ex.add_sequence(0)
    ex.add_sequence(1)
    out = ex.forward([chain_chunk(0, p0, 0), chain_chunk(1, p1, 0)])
    assert close(out[0], hf_logits(hf, p0)) and close(out[1], hf_logits(hf, p1))
    ex.commit(0, len(p0))
    ex.commit(1, len(p1))
    # seq 2 arrives later: prefill it alongside a decode of seq 0 and a verify of seq 1
    p2, glue1 = rand_tokens(8, 9), rand_tokens(4, 10)
    ex.add_sequence(2)
    out = ex.forward([chain_chunk(0, [3], len(p0)), chain_chunk(1, glue1, len(p1)),
                      chain_chunk(2, p2, 0, last_logits_only=True)])
    assert close(out[0], hf_logits(hf, p0 + [3])[-1:])
    assert close(out[1], hf_logits(hf, p1 + glue1)[len(p1):])
    assert close(out[2], hf_logits(hf, p2)[-1:])
    ex.commit(2, len(p2))
    # tree step on seq 1 (over its uncommitted glue) next to a decode of seq 2
    branches = [(0, [30]), (2, [31]), (3, [32])]
    out = ex.forward([tree_chunk(1, len(p1), len(glue1), branches, 0, [30, 31, 32]),
                      chain_chunk(2, [4], len(p2))])
    for i, (j, toks) in enumerate(branches):
        assert close(out[0][i : i + 1], hf_logits(hf, p1 + glue1[: j + 1] + toks)[-1:])
    assert close(out[1], hf_logits(hf, p2 + [4])[-1:])


def test_release_frees_a_row_for_a_new_sequence(setup):
    hf, directory = setup
    ex = new_executor(directory, max_seqs=2)
    prefill(ex, 0, rand_tokens(20, 11))
    prefill(ex, 1, rand_tokens(5, 12))
    with pytest.raises(CapacityError, match="max_seqs=2"):
        ex.add_sequence(2)
    ex.release(0)
    ex.release(0)  # idempotent
    with pytest.raises(ValueError, match="unknown seq_id 0"):
        ex.committed(0)
    ex.add_sequence(2)  # reuses seq 0's row: its old KV must not leak in
    assert ex.committed(2) == 0
    p = rand_tokens(6, 13)
    assert close(ex.forward([chain_chunk(2, p, 0)])[0], hf_logits(hf, p))


def test_capacity_errors(setup):
    hf, directory = setup
    ex = new_executor(directory, max_seqs=1, max_seq_len=16, max_batch_tokens=12)
    ex.add_sequence(0)
    with pytest.raises(CapacityError, match="max_batch_tokens"):
        ex.forward([chain_chunk(0, rand_tokens(13, 14), 0)])
    ex.forward([chain_chunk(0, rand_tokens(10, 15), 0)])
    ex.commit(0, 10)
    with pytest.raises(CapacityError, match="max_seq_len"):
        ex.forward([chain_chunk(0, rand_tokens(7, 16), 10)])
    ex.forward([chain_chunk(0, rand_tokens(6, 16), 10)])  # exactly fills the row: fine
    with pytest.raises(CapacityError, match="memory budget"):
        new_executor(directory, memory_budget_bytes=10_000)
    with pytest.raises(CapacityError, match="exceed the memory budget"):
        new_executor(directory, max_seq_len=1 << 20, memory_budget_bytes=1 << 30)


def test_bad_input_is_refused(setup):
    hf, directory = setup
    ex = new_executor(directory)
    prefill(ex, 0, rand_tokens(5, 17))
    t = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="only slots < 5 were written"):
        ex.commit(0, 1)
    with pytest.raises(ValueError, match="unknown seq_id 9"):
        ex.forward([chain_chunk(9, [1], 0)])
    with pytest.raises(ValueError, match="slots must lie in the region"):
        ex.forward([chain_chunk(0, [1], 4)])  # would overwrite the committed prefix
    with pytest.raises(ValueError, match="own slot"):
        blind = torch.tensor([[False, True], [True, True]])  # token 0 does not see slot 5
        ex.forward([Chunk(0, t, torch.tensor([5, 6]), torch.tensor([5, 6]), blind)])
    with pytest.raises(ValueError, match="same slot"):
        ex.forward([Chunk(0, t, torch.tensor([5, 6]), torch.tensor([5, 5]), torch.ones(2, 1, dtype=torch.bool))])
    with pytest.raises(ValueError, match="token ids"):
        ex.forward([chain_chunk(0, [VOCAB], 5)])
    with pytest.raises(ValueError, match="more than one chunk"):
        ex.forward([chain_chunk(0, [1], 5), chain_chunk(0, [2], 6)])
    # int32 ids are accepted like int64; float ids are refused
    ours = ex.forward([Chunk(0, t.int(), torch.tensor([5, 6], dtype=torch.int32), torch.tensor([5, 6]).int(),
                             torch.ones(2, 2, dtype=torch.bool).tril())])[0]
    assert close(ours, ex.forward([chain_chunk(0, [1, 2], 5)])[0])
    with pytest.raises(ValueError, match="tokens must be an integer tensor"):
        ex.forward([Chunk(0, t.float(), torch.tensor([5, 6]), torch.tensor([5, 6]), torch.ones(2, 2, dtype=torch.bool))])
    with pytest.raises(ValueError, match="mask must be bool"):
        ex.forward([Chunk(0, t, torch.tensor([5, 6]), torch.tensor([5, 6]), torch.ones(2, 2))])
    with pytest.raises(ValueError, match="already active"):
        ex.add_sequence(0)
    with pytest.raises(ValueError, match="max_seqs"):
        new_executor(directory, max_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        new_executor(directory, dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_executor_matches_transformers(setup):
    hf, directory = setup
    ex = new_executor(directory, device="cuda", logits_device="cuda")  # keep the logits where they are made
    prompt, glue = rand_tokens(10, 20), rand_tokens(3, 21)
    prefill(ex, 0, prompt)
    n = len(prompt)
    verify = ex.forward([chain_chunk(0, glue, n)])[0]
    assert verify.device.type == "cuda"
    assert (verify.cpu() - hf_logits(hf, prompt + glue)[n:]).abs().max() < 1e-3
    branches = [(0, [11]), (2, [12])]
    tree = ex.forward([tree_chunk(0, n, len(glue), branches, 0, [11, 12])])[0].cpu()
    for i, (j, toks) in enumerate(branches):
        assert (tree[i] - hf_logits(hf, prompt + glue[: j + 1] + toks)[-1]).abs().max() < 1e-3


def test_copy_slots_moves_kv_as_if_decoded_in_place(setup):
    hf, directory = setup
    ex = new_executor(directory)
    prompt, chain = rand_tokens(8, 30), rand_tokens(4, 31)
    prefill(ex, 0, prompt)
    n = len(prompt)
    # Decode the chain at logical positions n.. but into scratch slots n+10.., then move it.
    positions = torch.arange(n, n + 4)
    mask = torch.zeros(4, 14, dtype=torch.bool)
    mask[:, 10:] = torch.ones(4, 4, dtype=torch.bool).tril()  # region slots 10..13, causal
    ex.forward([Chunk(0, torch.tensor(chain), positions, positions + 10, mask)])
    ex.copy_slots(0, positions + 10, positions)
    ex.commit(0, 4)
    ours = ex.forward([chain_chunk(0, [9], n + 4)])[0]
    assert close(ours, hf_logits(hf, prompt + chain + [9])[-1:])
    with pytest.raises(ValueError, match="src slots must lie in the written region"):
        ex.copy_slots(0, torch.tensor([0]), torch.tensor([n + 4]))
    with pytest.raises(ValueError, match="dst slots must lie in"):
        ex.copy_slots(0, torch.tensor([n + 4]), torch.tensor([64]))
    with pytest.raises(ValueError, match="one length"):
        ex.copy_slots(0, torch.tensor([n + 4]), torch.tensor([n + 5, n + 6]))
