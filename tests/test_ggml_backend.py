"""The ggml executor (llama.cpp): rows bit-identical alone, in a verify chain, beside other
sequences and on tree lanes (what greedy exactness of sd/ssd against ar needs, checked so that a
llama.cpp upgrade that breaks it fails here), and sd/ssd output equal to ar on a ggml engine."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp")

from trtssd import LLM, SamplingParams  # noqa: E402
from trtssd.backends.base import Chunk, chain_chunk  # noqa: E402
from trtssd.backends.ggml_backend import GgmlExecutor  # noqa: E402
from trtssd.build import build_engine  # noqa: E402
from trtssd.config import ModelRef  # noqa: E402
from trtssd.spec_decode.tree import TreeLayout, append_chunk  # noqa: E402

from ggml_models import write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def smollm2_gguf():
    from trtssd.models.smollm2 import ensure_smollm2_gguf

    return ensure_smollm2_gguf()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensor_type="q8_0", scale=0.3)


def _ar_logits(ex: GgmlExecutor, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain greedy decoding one token per forward: the tokens and each step's logits."""
    ex.add_sequence(0)
    logits = ex.forward([chain_chunk(0, prompt, 0, last_logits_only=True)])[0][-1]
    ex.commit(0, len(prompt))
    tokens, rows = [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = ex.forward([chain_chunk(0, tokens[-1:], ex.committed(0))])[0][-1]
        ex.commit(0, 1)
        rows.append(logits)
    ex.release(0)
    return tokens, rows


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_bit_identical_in_verify_batch_and_tree(smollm2_gguf, threads):
    ex = GgmlExecutor(smollm2_gguf, max_seqs=4, max_seq_len=256, threads=threads)
    prompt = list(range(100, 140))
    n = len(prompt)
    seq, ref = _ar_logits(ex, prompt, 14)
    ex.add_sequence(1)
    ex.add_sequence(2)
    ex.forward([chain_chunk(2, list(range(300, 333)), 0, last_logits_only=True)])
    ex.commit(2, 33)
    ex.forward([chain_chunk(1, prompt, 0, last_logits_only=True)])
    ex.commit(1, n)
    # a verify chain beside another sequence's rows
    out = ex.forward([chain_chunk(1, seq[:6], n), chain_chunk(2, [5, 6, 7], 33)])[0]
    assert torch.equal(out, torch.stack(ref[:6]))
    # rejection: keep 2, verify again over the discarded cells
    ex.commit(1, 2)
    out = ex.forward([chain_chunk(1, seq[2:8], n + 2)])[0]
    assert torch.equal(out, torch.stack(ref[2:8]))
    ex.commit(1, 6)
    # glue, then tree branches leaving it at every depth (lanes sharing the glue cells)
    k, c = 3, ex.committed(1)
    glue = ex.forward([chain_chunk(1, seq[8:12], c)])[0]
    assert torch.equal(glue, torch.stack(ref[8:12]))
    layout = TreeLayout(1, c, k, torch.arange(4), torch.tensor(seq[9:13]))
    step0 = ex.forward([layout.step_chunk(0, layout.fork_token)])[0]
    assert torch.equal(step0, torch.stack(ref[9:13]))
    # a hit on the branch after depth 0: its cells become the chain, only the next token is new
    step1 = ex.forward([layout.step_chunk(1, step0.argmax(-1))])[0]
    ex.commit(1, 1)
    c2 = ex.committed(1)
    ex.copy_slots(1, layout.committed + layout.glue_len + torch.arange(2) * 4, c2 + torch.arange(2))
    out = ex.forward([append_chunk(1, c2, [int(step1[0].argmax())], 2)])[0]
    assert torch.equal(out[0], ref[11])  # the new token's cell lies above the branch's: same sums
    ex.release(1)
    ex.release(2)
    assert len(ex._free_lanes) == 254  # every lane back (two are the trash and the filler)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 40000 + 100 for i in range(n)]


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_independent_of_threads_neighbours_and_cache_history(smollm2_gguf, threads):
    """A long context (the cache past 512 cells, where a one-token forward on two threads splits
    it), a prompt prefilled after other requests came and went (alignment, tiles), verify chains
    with rejections (trash), a compaction, rows beside other sequences' rows: every row is
    bit-identical to plain one-thread decoding on a fresh executor."""
    prompt = _prompt(300)
    n = len(prompt)
    fresh = GgmlExecutor(smollm2_gguf, max_seqs=4, max_seq_len=1024, threads=1)
    seq, ref = _ar_logits(fresh, prompt, 24)
    fresh.close()
    ex = GgmlExecutor(smollm2_gguf, max_seqs=4, max_seq_len=1024, threads=threads)
    ex.add_sequence(7)  # another request comes and goes: the cache no longer starts where it did
    ex.forward([chain_chunk(7, _prompt(37, 1), 0)])
    ex.commit(7, 30)
    ex.release(7)
    ex.add_sequence(8)  # and one stays, 71 cells long, beside ours
    ex.forward([chain_chunk(8, _prompt(71, 2), 0, last_logits_only=True)])
    ex.commit(8, 71)
    ex.add_sequence(1)
    ex.forward([chain_chunk(1, prompt, 0, last_logits_only=True)])
    ex.commit(1, n)
    got = []
    for first, width, keep in ((0, 8, 3), (3, 8, 1), (4, 8, 8), (12, 6, 2)):
        out = ex.forward([chain_chunk(1, seq[first:first + width], n + first),
                          chain_chunk(8, [5, 6, 7], ex.committed(8))])[0]
        got.append((out[:keep], ref[first:first + keep]))
        ex.commit(1, keep)
        if first == 3:
            ex.compact()
    for out, expected in got:
        assert torch.equal(out, torch.stack(expected))
    out = ex.forward([chain_chunk(1, seq[14:24], n + 14)])[0]  # alone again
    assert torch.equal(out, torch.stack(ref[14:24]))
    ex.close()


def test_plain_decoding_on_borrowed_cores_keeps_rows_exact(smollm2_gguf):
    """One-token forwards on two threads over a long cache (a plain round of one row on the
    draft's cores too) get a filler row, so they equal one-thread decoding; without it llama.cpp
    splits the cache across the threads and the rows change (when this stops failing, the filler
    is no longer needed)."""
    prompt = _prompt(300, 5)
    ex = GgmlExecutor(smollm2_gguf, max_seqs=2, max_seq_len=1024, threads=1)
    _, ref = _ar_logits(ex, prompt, 8)
    ex.set_threads(2)
    _, lent = _ar_logits(ex, prompt, 8)
    ex.set_threads(2, split_single_rows=True)
    _, split = _ar_logits(ex, prompt, 8)
    ex.close()
    assert all(torch.equal(a, b) for a, b in zip(lent, ref))
    assert not all(torch.equal(a, b) for a, b in zip(split, ref))


def test_a_short_sequence_after_others_left_is_compacted_instead_of_padded(smollm2_gguf):
    """A request that came and went beside a running one leaves its cells in the trash, so the
    next short request's one-token forwards lie past the split: the cache is compacted once
    instead of a filler row beside every token (which trashes a cell per token), and the rows
    stay exact."""
    prompt = _prompt(40, 6)
    ex = GgmlExecutor(smollm2_gguf, max_seqs=3, max_seq_len=1024, threads=1)
    _, ref = _ar_logits(ex, prompt, 8)
    ex.close()
    ex = GgmlExecutor(smollm2_gguf, max_seqs=3, max_seq_len=1024, threads=2)
    for seq_id, n in ((4, 10), (3, 230)):  # 4 stays live; 3's trash stays below a compaction
        ex.add_sequence(seq_id)
        ex.forward([chain_chunk(seq_id, _prompt(n, seq_id), 0, last_logits_only=True)])
        ex.commit(seq_id, n)
    ex.release(3)
    _, got = _ar_logits(ex, prompt, 8)
    assert ex._trashed == 48  # the 40 + 8 cells just released; no filler was trashed on the way
    ex.close()
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_cache_holding_only_trash_is_emptied_at_no_cost(smollm2_gguf):
    """When the last live sequence leaves (one user's requests one after another), every cell is
    freed at once, with no compaction (which clears llama.cpp's whole cache buffer: its cost grows
    with the cache's size), and the next request's rows equal a fresh cache's bit for bit."""
    prompt = _prompt(40, 6)
    ex = GgmlExecutor(smollm2_gguf, max_seqs=2, max_seq_len=1024, threads=2)
    _, ref = _ar_logits(ex, prompt, 8)
    ex.add_sequence(3)
    ex.forward([chain_chunk(3, _prompt(230, 7), 0, last_logits_only=True)])
    ex.commit(3, 230)
    ex.release(3)
    assert (ex._allocated, ex._trashed) == (0, 0)
    _, got = _ar_logits(ex, prompt, 8)
    assert ex.upkeep_s == 0.0  # never compacted
    ex.close()
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def _region_chunk(seq_id: int, tokens: list[int], positions: list[int], slots: list[int],
                  mask: list[list[int]]) -> Chunk:
    return Chunk(seq_id, torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots),
                 torch.tensor(mask, dtype=torch.bool))


def test_a_compaction_lays_shared_and_branching_cells_back_exactly(smollm2_gguf, monkeypatch):
    """A compaction copies out only the live cells, group by group of the lanes holding them (a
    prefix two sequences share, a tree's trunk and its branches), and lays them back without
    clearing llama.cpp's whole cache: the next forward's rows equal those without a compaction,
    bit for bit."""

    def run(compact: bool) -> list[torch.Tensor]:
        ex = GgmlExecutor(smollm2_gguf, max_seqs=4, max_seq_len=256, threads=2)
        for seq_id, prompt in ((0, _prompt(40, 1)), (9, _prompt(50, 9))):
            ex.add_sequence(seq_id)
            ex.forward([chain_chunk(seq_id, prompt, 0, last_logits_only=True)])
            ex.commit(seq_id, len(prompt))
        ex.release(9)  # its cells go to the trash below the live ones that follow
        ex.add_sequence(1)
        ex.share_prefix(0, 1, 16)
        ex.forward([chain_chunk(1, _prompt(12, 2), 16, last_logits_only=True)])
        ex.commit(1, 12)
        ex.add_sequence(2)
        ex.forward([chain_chunk(2, _prompt(20, 3), 0, last_logits_only=True)])
        ex.commit(2, 20)
        rows = ex.forward([chain_chunk(2, [11, 12], 20), chain_chunk(0, [5, 6], 40), chain_chunk(1, [7], 28)])
        ex.commit(0, 2)
        # A branch beside token 12: tokens 13 and 14 continue token 11 (slots 22 and 23).
        rows += ex.forward([_region_chunk(2, [13, 14], [21, 22], [22, 23], [[1, 0, 1, 0], [1, 0, 1, 1]])])
        if compact:
            ex.compact()
            assert ex._trashed == 0 and ex.upkeep_s > 0
        rows += ex.forward([_region_chunk(2, [15], [23], [24], [[1, 0, 1, 1, 1]]),  # on the branch
                            chain_chunk(0, [8], 42), chain_chunk(1, [9, 10], 28)])
        ex.close()
        return rows

    def whole_state(self):
        raise AssertionError("a compaction cleared llama.cpp's whole cache")

    monkeypatch.setattr(GgmlExecutor, "_restore_whole_state", whole_state)
    expected, got = run(False), run(True)
    assert len(got) == len(expected) == 7
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_lane_that_leaves_a_group_and_comes_back_is_compacted_whole():
    """Groups laid one after another cannot keep a lane's cells in order when its cells go from
    one group to another and back: no group order, so the compaction saves the whole state."""
    from trtssd.backends.ggml_backend import _Cell, _restore_order

    a, b, c = _Cell(0), _Cell(1), _Cell(2)
    assert _restore_order({1: [a, b, c], 2: [a, c]}) is None
    order = _restore_order({1: [a, b], 2: [a, c]})
    assert [lanes for lanes, _ in order][0] == (1, 2) and {lanes for lanes, _ in order} == {(1, 2), (1,), (2,)}


def test_a_full_cache_copies_at_most_two_cells_per_cell_its_compactions_free(tiny_gguf):
    """A sequence near max_seq_len whose rounds are all rejected (8 cells to the trash each): the
    cache has room for trash of half its sequences' cells, so a compaction, which copies every
    live cell, comes at most once per half as many trashed cells as it copies."""
    ex = GgmlExecutor(tiny_gguf, max_seqs=1, max_seq_len=4096, threads=1)
    ex.add_sequence(0)
    live = 4080
    ex.forward([chain_chunk(0, [(i * 7) % 500 + 5 for i in range(live)], 0, last_logits_only=True)])
    ex.commit(0, live)
    rounds = 600
    for r in range(rounds):  # never committed: the next round's forward trashes this one's cells
        ex.forward([chain_chunk(0, [(r + j) % 500 + 5 for j in range(8)], live)])
    freed = 8 * (rounds - 1)
    compactions = ex._compactions
    ex.close()
    assert 1 <= compactions and compactions * live <= 2 * freed


def test_long_chains_are_cut_and_aligned_the_same_way(smollm2_gguf):
    """A prompt of 600 tokens (cut at 512) prefilled on a fresh cache and after 45 cells of
    another sequence: the same first logits row, bit for bit."""
    prompt = _prompt(600, 3)
    rows = []
    for other in (0, 45):
        ex = GgmlExecutor(smollm2_gguf, max_seqs=2, max_seq_len=1024, threads=1)
        if other:
            ex.add_sequence(5)
            ex.forward([chain_chunk(5, _prompt(other, 4), 0)])
            ex.commit(5, other)
        ex.add_sequence(0)
        rows.append(ex.forward([chain_chunk(0, prompt, 0, last_logits_only=True)])[0][-1])
        ex.close()
    assert torch.equal(rows[0], rows[1])


def test_a_file_without_tiled_weights_decodes_every_row_in_one_forward(smollm2_gguf, tiny_gguf, monkeypatch):
    """SmolLM2's Q4_1 / Q8_0 weights (and a Q8_0 file) never go to llama.cpp's tiled matmul, so
    the rows of 12 sequences, and short prompts beside them, run in one llama_decode of up to 63
    tokens: every row bit-identical to the same sequence decoded alone."""
    from trtssd.backends import ggml_backend

    assert ggml_backend.widest_exact_piece(smollm2_gguf) == 63
    assert ggml_backend.widest_exact_piece(tiny_gguf) == 63
    with monkeypatch.context() as m:  # the tiled matmul off: every file decodes wide
        m.setenv("GGML_CPU_TILED_MM", "0")
        assert ggml_backend.widest_exact_piece(smollm2_gguf) == 63
    prompts = [_prompt(20 + 3 * s, s) for s in range(12)]
    refs = []
    for p in prompts:
        ex = GgmlExecutor(smollm2_gguf, max_seqs=1, max_seq_len=256, threads=2)
        refs.append(_ar_logits(ex, p, 3))
        ex.close()
    ex = GgmlExecutor(smollm2_gguf, max_seqs=12, max_seq_len=512, threads=2)
    decodes = []
    real = ex._decode
    monkeypatch.setattr(ex, "_decode", lambda entries: decodes.append(len(entries)) or real(entries))
    for s in range(12):
        ex.add_sequence(s)
    # Two short prompts in one forward (20 + 23 tokens): one decode, as their rows are invariant.
    first = ex.forward([chain_chunk(s, prompts[s], 0, last_logits_only=True) for s in range(2)])
    assert decodes == [43]
    rest = ex.forward([chain_chunk(s, prompts[s], 0, last_logits_only=True) for s in range(2, 12)])
    tokens = [[int(o[-1].argmax())] for o in first + rest]
    for s in range(12):
        ex.commit(s, len(prompts[s]))
    decodes.clear()
    for step in range(3):
        outs = ex.forward([chain_chunk(s, tokens[s][-1:], ex.committed(s)) for s in range(12)])
        for s in range(12):
            ex.commit(s, 1)
            assert torch.equal(outs[s][-1], refs[s][1][step]), (s, step)
            tokens[s].append(int(outs[s][-1].argmax()))
    assert decodes == [12, 12, 12]  # one forward a step, not pieces of 7
    assert [t[:3] for t in tokens] == [r[0] for r in refs]
    ex.close()


def test_non_tree_mask_is_refused(tiny_gguf):
    ex = GgmlExecutor(tiny_gguf, max_seqs=1, max_seq_len=64, threads=1)
    ex.add_sequence(0)
    ex.forward([chain_chunk(0, [1, 2, 3], 0)])
    ex.commit(0, 1)
    gap = Chunk(0, torch.tensor([4]), torch.tensor([5]), torch.tensor([1]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="continue the position"):
        ex.forward([gap])


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_tiny_gguf_greedy_equals_ar(tiny_gguf, mode):
    ref = ModelRef(str(tiny_gguf), backend="ggml")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [300, 301, 302, 303, 304], [40]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(target=ref, draft=ref, mode="ar", launch="local", max_batch=4, max_model_len=128) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(target=ref, draft=ref, mode=mode, launch="local", k=3, max_batch=4, max_model_len=128,
             plain_under_load=False) as llm:
        batch4 = [o.token_ids for o in llm.generate(prompts, params)]
        batch1 = [llm.generate([p], params)[0].token_ids for p in prompts[:2]]
    assert batch4 == expected and batch1 == expected[:2]


@pytest.mark.slow
@pytest.mark.mpi
def test_default_engine_on_ggml_greedy_equals_ar(tmp_path):
    engine = build_engine(out_dir=tmp_path, backend="ggml", progress=False)
    prompts = ["def fibonacci(n):", "Write a haiku about the sea.", "The capital of France is", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = {}
    for mode in ("ar", "sd", "ssd"):
        with LLM(str(engine), mode=mode, max_batch=4, max_model_len=256, plain_under_load=False) as llm:
            outs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["sd"] == outs["ar"] and outs["ssd"] == outs["ar"]


def test_without_row_invariance_forwards_go_to_llama_cpp_whole(tmp_path, smollm2_gguf, monkeypatch):
    """``row_invariant=False`` (RuntimeConfig, ``--no-row-invariant``): a forward is one
    llama_decode, however wide (as llama-server batches); an engine serves every mode with it."""
    ex = GgmlExecutor(smollm2_gguf, max_seqs=12, max_seq_len=512, threads=2, row_invariant=False)
    decodes = []
    real = ex._decode
    monkeypatch.setattr(ex, "_decode", lambda entries: decodes.append(len(entries)) or real(entries))
    for s in range(12):
        ex.add_sequence(s)
    ex.forward([chain_chunk(s, _prompt(30, s), 0, last_logits_only=True) for s in range(12)])
    assert decodes == [360]
    ex.close()
    engine = build_engine(out_dir=tmp_path, backend="ggml", progress=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for mode in ("ar", "ssd"):
        with LLM(str(engine), mode=mode, max_batch=4, max_model_len=256, plain_under_load=False,
                 row_invariant=False) as llm:
            assert llm.loop.target.row_invariant is False
            outs = llm.generate(["def fibonacci(n):", "The capital of France is"], params)
            assert [len(o.token_ids) for o in outs] == [24, 24]


def test_a_lone_plain_row_verifies_an_ngram_guess_in_its_filler_row(tmp_path, monkeypatch):
    """A plain round of one row over a long cache on two threads carries a filler row
    (GgmlExecutor.spare_rows): outside ar mode it verifies an n-gram guess there instead, as a
    point mass. Greedy output stays ar's token for token, and accepted guesses emit two tokens
    in one forward."""
    engine = build_engine(out_dir=tmp_path, backend="ggml", progress=False)
    prompt = "Count: " + ", ".join(str(i % 10) for i in range(150))  # past 256 cells: filler rows
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(str(engine), mode="ar", max_batch=2, max_model_len=512) as llm:
        ar = llm.generate([prompt], params)[0].token_ids
        assert llm.metrics.summary()["spare_row_guesses"] == 0  # ar rounds are the reference
    with LLM(str(engine), mode="sd", max_batch=2, max_model_len=512) as llm:
        monkeypatch.setattr(llm.loop.policy, "speculate", lambda rows: False)  # load control: plain rounds
        out = llm.generate([prompt], params)[0]
        summary = llm.metrics.summary()
    assert out.token_ids == ar
    assert summary["spare_row_guesses"] > 20 and summary["spare_row_guesses_accepted"] > 10
    assert summary["plain_rounds"] < 60  # accepted guesses: fewer forwards than tokens


def test_a_prompt_beside_decoding_rows_shares_their_forward_bit_for_bit(smollm2_gguf, monkeypatch):
    """A short prompt and the decode rows of running sequences in one forward (a plain round that
    carries a prompt piece) are one llama_decode on a file without tiled weights, and every row,
    the prompt's last included, equals the same row computed alone."""
    prompts = [_prompt(30, 1), _prompt(41, 2), _prompt(17, 3)]
    refs = []
    for p in prompts:
        ex = GgmlExecutor(smollm2_gguf, max_seqs=1, max_seq_len=256, threads=2)
        ex.add_sequence(0)
        first = ex.forward([chain_chunk(0, p, 0, last_logits_only=True)])[0][-1]
        ex.release(0)
        refs.append((first, _ar_logits(ex, p, 3)))
        ex.close()
    ex = GgmlExecutor(smollm2_gguf, max_seqs=3, max_seq_len=256, threads=2)
    decodes = []
    real = ex._decode
    monkeypatch.setattr(ex, "_decode", lambda entries: decodes.append(len(entries)) or real(entries))
    tokens = []
    for s in range(2):
        ex.add_sequence(s)
        ex.forward([chain_chunk(s, prompts[s], 0, last_logits_only=True)])
        ex.commit(s, len(prompts[s]))
        tokens.append(refs[s][1][0][0])
    ex.add_sequence(2)
    decodes.clear()
    outs = ex.forward([chain_chunk(2, prompts[2], 0, last_logits_only=True)]
                      + [chain_chunk(s, [tokens[s]], ex.committed(s)) for s in range(2)])
    assert decodes == [17 + 2]
    assert torch.equal(outs[0][-1], refs[2][0])
    for s in range(2):
        assert torch.equal(outs[1 + s][-1], refs[s][1][1][0]), s
    ex.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_prompts_carried_in_plain_rounds_equal_each_request_alone(tmp_path, monkeypatch, mode):
    """The default engine (ggml): requests arriving while others decode have their prompts
    prefilled in the running rows' plain round (in ssd as load control's plain rounds). Every
    request's tokens and logprobs equal those of the request decoded alone in ar, bit for bit."""
    from arrivals import arriving

    engine = build_engine(out_dir=tmp_path, backend="ggml", progress=False)
    # Short prompts and a long one (a tiled chain beside the rows' forward).
    prompts = [_prompt(n, s) for s, n in enumerate([12, 30, 5, 90, 21, 47])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    with LLM(str(engine), mode="ar", max_batch=4, max_model_len=256) as llm:
        alone, carried = arriving(llm.loop, prompts, params, every=None)
        assert carried == 0
    with LLM(str(engine), mode=mode, max_batch=4, max_model_len=256) as llm:
        if mode != "ar":  # load control chooses plain rounds (what it does on two cores)
            monkeypatch.setattr(llm.loop.policy, "speculate", lambda rows: False)
            monkeypatch.setattr(llm.loop.policy, "expects_plain", lambda rows: True)
        together, carried = arriving(llm.loop, prompts, params, every=3)
    assert carried >= 5
    assert [s.output for s in together] == [s.output for s in alone]
    assert [s.logprobs for s in together] == [s.logprobs for s in alone]
