"""Prefix caching and chunked prefill (trtssd/runtime/prefix_cache.py, trtssd/runtime/scheduler.py): a
prompt split where the executor allows it writes one prefill's KV (bit for bit on llama.cpp), the
cache finds the longest cached prefix, never a wrong one, and evicts least recently used without
losing a request; outputs with the cache and with chunks equal outputs without, on both ranks."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from trtssd import LLM, ModelRef, SamplingParams
from trtssd.backends.base import CapacityError, ExecutorCapabilities, PromptSplits, chain_chunk
from trtssd.runtime import prefix_cache as prefix_cache_module
from trtssd.runtime.prefix_cache import PrefixCache


def _prompt(n: int, seed: int, vocab: int = 2000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _prefill(ex, seq_id: int, tokens: list[int], start: int) -> torch.Tensor:
    chunk = dataclasses.replace(chain_chunk(seq_id, tokens, start, last_logits_only=True), prompt=True)
    row = ex.forward([chunk])[0][-1]
    ex.commit(seq_id, len(tokens))
    return row


# --- where a prompt may be split ---------------------------------------------------------------

def test_tiled_splits_keep_each_row_on_one_prefills_kernels():
    pytest.importorskip("llama_cpp")
    from trtssd.backends.ggml_backend import TiledPromptSplits

    s = TiledPromptSplits(63)  # a file whose matmuls keep rows exact in any forward below 64 tokens
    assert [at for at in range(1, 300) if s.allows(at, 300)] == [64, 128, 192]  # the rest at 256 is 44 < 64
    # A short prompt: one-row kernels whatever the split, after any token; never found by a long one.
    assert [at for at in range(1, 60) if s.allows(at, 60)] == list(range(1, 60))
    assert s.last_split(0, 37, 60) == 37 and s.next_split(37, 60) == 38
    assert s.kind(60) != s.kind(64)
    k_quant = TiledPromptSplits(7)  # the tiled matmul from 8 rows, by block: the rest stays at 8 or more
    assert [at for at in range(1, 60) if k_quant.allows(at, 60)] == [16, 32, 48]
    assert [at for at in range(1, 40) if k_quant.allows(at, 40)] == [16, 32]
    assert [at for at in range(1, 36) if k_quant.allows(at, 36)] == [16]  # 36 - 32 = 4 rows: one-row matmul
    assert [at for at in range(1, 7) if k_quant.allows(at, 7)] == list(range(1, 7))  # one-row kernels only
    assert k_quant.last_split(0, 37, 40) == 32
    assert k_quant.kind(7) != k_quant.kind(8) != k_quant.kind(64)
    # At the cut (512) the short rest is a piece of one prefill too.
    assert [at for at in range(1, 530) if s.allows(at, 530)] == [64, 128, 192, 256, 320, 384, 448, 512]
    assert not s.allows(512, 513)  # one prefill decodes a last single token with its neighbour
    assert s.last_split(0, 300, 1100) == 256 and s.last_split(256, 300, 1100) is None
    assert s.next_split(0, 300) == 64 and s.next_split(192, 300) == 300
    assert PromptSplits().last_split(10, 50, 40) == 39 and PromptSplits().next_split(10, 40) == 11


@pytest.mark.parametrize("length", [45, 200, 600])
def test_ggml_prompt_split_where_allowed_equals_one_prefill_bit_for_bit(length):
    """Every allowed split (a cached prefix, or chunked prefill's cut) gives the prompt's last
    logits and the next forward's bit for bit, on the default engine's GGUF."""
    pytest.importorskip("llama_cpp")
    from trtssd.backends.ggml_backend import GgmlExecutor
    from trtssd.models.smollm2 import ensure_smollm2_gguf

    ex = GgmlExecutor(ensure_smollm2_gguf(), max_seqs=2, max_seq_len=700, threads=1)
    prompt = _prompt(length, length)
    ex.add_sequence(0)
    whole = _prefill(ex, 0, prompt, 0)
    after = ex.forward([chain_chunk(0, [5, 6, 7], length)])[0]
    ex.release(0)
    splits = [at for at in range(1, length) if ex.capabilities.prompt_splits.allows(at, length)]
    assert splits
    for i, at in enumerate(sorted({splits[0], splits[len(splits) // 2], splits[-1]}), start=1):
        ex.add_sequence(i)
        _prefill(ex, i, prompt[:at], 0)
        assert torch.equal(_prefill(ex, i, prompt[at:], at), whole), at
        assert torch.equal(ex.forward([chain_chunk(i, [5, 6, 7], length)])[0], after), at
        ex.release(i)
    ex.close()


def test_short_prompts_sharing_a_template_reuse_it_and_long_prompts_never_do():
    """Chat prompts shorter than a tile share their template's blocks on llama.cpp (one-row
    kernels, no alignment): a saved 45-token prompt gives a 50-token one the 35 tokens they
    share, bit for bit; a long prompt's prefix, written on tiled attention, is not found by a short
    prompt, nor a short one's by a long prompt."""
    pytest.importorskip("llama_cpp")
    from trtssd.backends.ggml_backend import GgmlExecutor
    from trtssd.models.smollm2 import ensure_smollm2_gguf

    template = _prompt(40, 11)
    short_a, short_b, long_c = template[:35] + [7] * 10, template[:35] + [9] * 15, template + _prompt(60, 12)
    ex = GgmlExecutor(ensure_smollm2_gguf(), max_seqs=2, max_seq_len=256, threads=2)
    ex.add_sequence(0)
    fresh = _prefill(ex, 0, short_b, 0)
    ex.release(0)
    cache = PrefixCache(ex, max_kept=4)
    for seq_id, prompt in ((1, short_a), (2, long_c)):
        assert cache.start(seq_id, prompt) == 0
        _prefill(ex, seq_id, prompt, 0)
        cache.index(seq_id, prompt)
        cache.finish(seq_id)
    assert cache.start(3, short_b) == 35  # short_a's prompt; long_c's is of another kind
    assert torch.equal(_prefill(ex, 3, short_b[35:], 35), fresh)
    assert cache.start(4, template + _prompt(70, 13)) == 0  # a long prompt never reuses short_a's
    ex.close()


@pytest.mark.parametrize("how", ["chunked", "shared"])
def test_ggml_prompt_continued_after_a_compaction_equals_one_prefill_bit_for_bit(how):
    """A compaction packs live cells from cell 0, moving a prefix off the 64-cell alignment its
    prompt's later pieces are tiled by: the executor lays it again before the next long chain.
    A chunked prompt's second piece, and the rest of a prompt sharing a running one's prefix."""
    pytest.importorskip("llama_cpp")
    from trtssd.backends.ggml_backend import GgmlExecutor
    from trtssd.models.smollm2 import ensure_smollm2_gguf

    ex = GgmlExecutor(ensure_smollm2_gguf(), max_seqs=4, max_seq_len=400, threads=1)
    prompt = _prompt(300, 3)
    ex.add_sequence(0)
    whole = _prefill(ex, 0, prompt, 0)
    ex.release(0)
    for seq_id, n in ((1, 90), (2, 37)):  # 37 live cells will sit before what follows
        ex.add_sequence(seq_id)
        _prefill(ex, seq_id, _prompt(n, seq_id), 0)
    ex.release(1)
    ex.add_sequence(5)
    if how == "chunked":
        _prefill(ex, 5, prompt[:128], 0)
    else:
        ex.add_sequence(4)
        _prefill(ex, 4, prompt, 0)
        ex.share_prefix(4, 5, 128)
    ex.compact()
    assert torch.equal(_prefill(ex, 5, prompt[128:], 128), whole)
    ex.close()


def test_ggml_prefix_saved_out_of_the_cache_and_loaded_back_equals_one_prefill_bit_for_bit():
    """A finished prompt's KV copied to host memory and loaded into a new sequence, after other
    requests came and went, in part (a shorter cached prefix) or whole, gives a fresh prefill's
    logits bit for bit; the saved sequence leaves llama.cpp's cache."""
    pytest.importorskip("llama_cpp")
    from trtssd.backends.ggml_backend import GgmlExecutor
    from trtssd.models.smollm2 import ensure_smollm2_gguf

    ex = GgmlExecutor(ensure_smollm2_gguf(), max_seqs=3, max_seq_len=400, threads=2)
    prompt = _prompt(300, 3)
    ex.add_sequence(0)
    whole = _prefill(ex, 0, prompt, 0)
    after = ex.forward([chain_chunk(0, [5, 6, 7], 300)])[0]
    ex.commit(0, 2)  # generated tokens past the prompt are not saved
    saved = ex.save_prefix(0, 256)
    ex.release(0)
    for seq_id, other in ((1, _prompt(90, 4)), (2, _prompt(37, 5))):  # the cache's history moves on
        ex.add_sequence(seq_id)
        _prefill(ex, seq_id, other, 0)
    ex.release(1)
    for i, at in enumerate((128, 192), start=10):  # splits a prefill allows (a cached prefix ends there)
        ex.add_sequence(i)
        ex.load_prefix(i, saved, at)
        assert ex.committed(i) == at
        assert torch.equal(_prefill(ex, i, prompt[at:], at), whole), at
        assert torch.equal(ex.forward([chain_chunk(i, [5, 6, 7], 300)])[0], after), at
        ex.release(i)
    with pytest.raises(ValueError, match="n_tokens"):
        ex.add_sequence(20)
        ex.load_prefix(20, saved, 257)
    ex.close()


# --- the cache's bookkeeping --------------------------------------------------------------------

class _Rows:
    """An executor's sequence bookkeeping alone (what PrefixCache calls), recording shares."""

    capabilities = ExecutorCapabilities(max_batch_tokens=256, shares_prefix=True)

    def __init__(self, max_seqs: int):
        self.max_seqs, self.live, self.shares, self.committed = max_seqs, set(), [], {}

    def add_sequence(self, seq_id):
        if len(self.live) >= self.max_seqs:
            raise CapacityError("full")
        self.live.add(seq_id)

    def release(self, seq_id):
        self.live.discard(seq_id)

    def share_prefix(self, src, dst, n):
        assert src in self.live and dst in self.live
        self.shares.append((src, dst, n))


def test_longest_cached_prefix_is_shared():
    rows = _Rows(8)
    cache = PrefixCache(rows, max_kept=4)
    a, b = _prompt(100, 1), _prompt(100, 2)
    assert cache.start(0, a) == 0
    cache.index(0, a)
    cache.finish(0)  # kept
    assert cache.start(1, b) == 0
    assert cache.start(2, a[:70] + b) == 70  # found by its blocks, followed token by token
    assert cache.start(3, a) == 99  # never the whole prompt: its last logits must be computed
    assert cache.start(6, a[:15] + b) == 0  # not one whole block in common: nothing finds it
    assert rows.shares == [(0, 2, 70), (0, 3, 99)]
    cache.index(1, b)  # a running sequence holds its blocks too
    assert cache.start(4, b + [7]) == 100 and rows.shares[-1][0] == 1
    assert cache.start(5, a, reuse=False) == 0  # a request that wants every prompt row's logits


def _run_to_the_end(cache: PrefixCache, n: int) -> list[list[int]]:
    """Sequences 0..n-1 on distinct 40-token prompts, each prefilled, indexed and finished."""
    prompts = [_prompt(40, seed) for seed in range(n)]
    for i, p in enumerate(prompts):
        cache.start(i, p)
        cache.index(i, p)
        cache.finish(i)
    return prompts


def test_least_recently_used_goes_first_and_a_full_executor_evicts_instead_of_refusing():
    rows = _Rows(3)
    cache = PrefixCache(rows, max_kept=2)
    prompts = _run_to_the_end(cache, 3)
    assert rows.live == {1, 2}  # max_kept 2: the oldest (0) went
    assert cache.start(10, prompts[1] + [1]) == 40  # 1 is now the most recently used
    cache.start(11, _prompt(40, 9))  # the executor is full: the least recently used (2) goes
    assert rows.live == {1, 10, 11}
    with pytest.raises(CapacityError):  # only running sequences left: the executor's own error
        cache.start(12, _prompt(40, 8)), cache.start(13, _prompt(40, 7))


def test_a_full_executor_evicts_the_holder_a_new_request_reuses_last():
    rows = _Rows(3)
    cache = PrefixCache(rows, max_kept=None)
    prompts = _run_to_the_end(cache, 2)  # 0 and 1 kept, 0 the least recently used
    cache.start(2, _prompt(40, 9))  # running: the executor is full
    assert cache.start(3, prompts[0] + [1]) == 40 and rows.live == {0, 2, 3}  # 1 went, not its holder
    rows2 = _Rows(2)
    cache = PrefixCache(rows2, max_kept=None)
    prompts = _run_to_the_end(cache, 1)
    cache.start(1, _prompt(40, 9))
    assert cache.start(2, prompts[0] + [1]) == 0 and rows2.live == {1, 2}  # the only room was the holder's


class _SavingRows(_Rows):
    """An executor that copies a finished prompt out (llama.cpp's host-memory prompt cache)."""

    capabilities = ExecutorCapabilities(max_batch_tokens=256, shares_prefix=True, saves_prefix=True)

    def __init__(self, max_seqs: int):
        super().__init__(max_seqs)
        self.loads = []

    def save_prefix(self, seq_id, n):
        assert seq_id in self.live
        return _Saved(seq_id, n, size=n << 16)  # 40 tokens: 2.5 MiB

    def load_prefix(self, seq_id, saved, n):
        assert seq_id in self.live and n <= saved.n_tokens
        self.loads.append((saved.seq_id, seq_id, n))


@dataclasses.dataclass(frozen=True)
class _Saved:
    seq_id: int
    n_tokens: int
    size: int  # bytes in host memory


def test_an_executor_that_saves_prefixes_holds_only_running_sequences():
    rows = _SavingRows(2)
    cache = PrefixCache(rows, max_kept=2)
    prompts = _run_to_the_end(cache, 3)
    assert rows.live == set()  # kept in host memory, released from the executor
    assert cache.start(10, prompts[2] + [1]) == 40 and rows.loads == [(2, 10, 40)] and not rows.shares
    cache.index(10, prompts[2] + [1])  # running: a later hit shares its rows instead
    assert cache.start(11, prompts[2] + [2]) == 40 and rows.shares == [(10, 11, 40)]
    with pytest.raises(CapacityError):  # saved prompts hold no executor sequence to give back
        cache.start(12, prompts[0])
    cache.finish(11)  # unindexed: released
    assert cache.start(12, prompts[0]) == 0  # evicted: two kept (1 and 2)
    cache.finish(12)
    assert cache.start(13, prompts[1] + [3]) == 40 and rows.loads[-1] == (1, 13, 40)


def test_prompts_saved_to_host_memory_are_bounded_by_their_bytes_and_any_count():
    rows = _SavingRows(2)
    cache = PrefixCache(rows, max_kept=None, max_mib=6)  # room for two 2.5 MiB prompts
    prompts = _run_to_the_end(cache, 4)
    assert [cache.start(10 + i, p + [1]) for i, p in enumerate(prompts[:2])] == [0, 0]  # the oldest went
    for i in (10, 11):
        cache.finish(i)  # unindexed: released
    assert cache.start(12, prompts[3] + [1]) == 40 and cache.start(13, prompts[2] + [1]) == 40
    cache = PrefixCache(_SavingRows(2), max_kept=None, max_mib=2048)  # no count of its own: 12 kept
    prompts = _run_to_the_end(cache, 12)
    assert cache.start(20, prompts[0] + [1]) == 40
    cache = PrefixCache(_SavingRows(2), max_kept=3, max_mib=2048)  # a count too: the tighter bound
    prompts = _run_to_the_end(cache, 5)
    assert cache.start(20, prompts[1] + [1]) == 0 and cache.start(21, prompts[2] + [1]) == 40


def test_with_no_count_kept_sequences_fill_the_executors_room_and_give_it_back():
    rows = _Rows(4)
    cache = PrefixCache(rows, max_kept=None)
    prompts = _run_to_the_end(cache, 6)
    assert rows.live == {2, 3, 4, 5}  # each new one evicted the least recently used
    assert cache.start(10, prompts[5] + [1]) == 40 and rows.live == {3, 4, 5, 10}


def test_a_hash_collision_is_a_miss_never_a_wrong_prefix(monkeypatch):
    monkeypatch.setattr(prefix_cache_module, "block_hashes", lambda tokens, block, kind=0: [7] * (len(tokens) // block))
    rows = _Rows(4)
    cache = PrefixCache(rows, max_kept=2)
    cache.start(0, _prompt(64, 1))
    cache.index(0, _prompt(64, 1))
    assert cache.start(1, _prompt(64, 2)) == 0 and not rows.shares


def test_an_executor_without_share_prefix_caches_nothing():
    class NoShare:
        capabilities = ExecutorCapabilities(max_batch_tokens=256)  # shares_prefix False

        def __init__(self):
            self.live = set()

        add_sequence, release = _Rows.add_sequence, _Rows.release
        max_seqs = 2

    rows = NoShare()
    cache = PrefixCache(rows, max_kept=4)
    assert not cache.enabled
    cache.start(0, _prompt(64, 1))
    cache.index(0, _prompt(64, 1))
    cache.finish(0)
    assert rows.live == set()


# --- outputs with and without ------------------------------------------------------------------

VOCAB = 64  # the tiny pair's (tests/tiny_models.py); the tiny GGUF's is larger
SHARED = _prompt(150, 42, vocab=VOCAB)
PROMPTS = [SHARED + _prompt(n, seed, vocab=VOCAB) for n, seed in ((20, 1), (3, 2), (90, 3))] + [_prompt(30, 4, VOCAB)]


def _outputs(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], list[int], list[int]]:
    """Greedy outputs of PROMPTS one after another (each may reuse the ones before), with the
    prompt tokens each took from the target's and the draft's caches."""
    outs = [llm.generate([p], params)[0] for p in PROMPTS + PROMPTS[:1]]
    return ([o.token_ids for o in outs], [o.num_cached_tokens for o in outs],
            [o.speculation.draft_cached_tokens for o in outs])


def _executor_sequences(llm: LLM) -> tuple[int, ...]:
    """How many sequences the target's executor (and the local draft's, if any) can hold."""
    draft = llm.loop.draft
    return (llm.loop.target.max_seqs,) + ((draft.server.worker.executor.max_seqs,) if draft is not None else ())


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_torch_outputs_with_prefix_cache_and_chunks_equal_outputs_without(tiny_llm, mode):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with tiny_llm(mode=mode, prefix_cache_seqs=0, prefill_chunk=0, k=3, plain_under_load=False) as llm:
        expected, cached, _ = _outputs(llm, params)
    assert cached == [0] * 5
    with tiny_llm(mode=mode, prefix_cache_seqs=2, prefill_chunk=48, k=3, plain_under_load=False) as llm:
        got, cached, draft_cached = _outputs(llm, params)
        # torch keeps the kept prompts as sequences: room for them beside the running batch (8).
        assert _executor_sequences(llm) == ((10, 10) if mode != "ar" else (10,))
    assert got == expected
    # The second and third share the first's 150 tokens (found by 16-token blocks, followed token
    # by token). The first's own prompt was evicted by then (two kept): its repeat finds the
    # shared part in the third's.
    assert cached == [0, 150, 150, 0, 150]
    if mode != "ar":
        assert draft_cached == cached


def test_seeded_sampled_requests_take_no_prefix_whose_reuse_only_rounds_alike(tiny_llm):
    """torch's split prefill equals one prefill up to rounding only: a seeded sampled request,
    whose seed promises the same draws, prefills its whole prompt on both ranks (greedy ones still
    reuse); its outputs equal those without the cache."""
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with tiny_llm(prefix_cache_seqs=0, k=3, plain_under_load=False) as llm:
        expected, _, _ = _outputs(llm, seeded)
    with tiny_llm(prefix_cache_seqs=2, k=3, plain_under_load=False) as llm:
        got, cached, draft_cached = _outputs(llm, seeded)
        _, greedy_cached, _ = _outputs(llm, greedy)
    assert got == expected
    assert cached == draft_cached == [0] * 5
    assert greedy_cached[1:3] == [150, 150]


def test_only_executors_whose_split_prefill_keeps_the_bits_give_seeded_requests_a_prefix():
    from trtssd.backends.ggml_backend import TiledPromptSplits

    seeded = SamplingParams(temperature=0.7, seed=1)
    rows = _Rows(8)
    assert not PrefixCache(rows, 4).reuse_keeps_bits(seeded)
    assert PrefixCache(rows, 4).reuse_keeps_bits(SamplingParams(temperature=0.7))
    assert PrefixCache(rows, 4).reuse_keeps_bits(SamplingParams(temperature=0, seed=1))
    rows.capabilities = dataclasses.replace(rows.capabilities, prompt_splits=TiledPromptSplits(7))
    assert PrefixCache(rows, 4).reuse_keeps_bits(seeded)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_ggml_outputs_with_prefix_cache_and_chunks_equal_outputs_without(tmp_path_factory, mode):
    pytest.importorskip("llama_cpp")
    from ggml_models import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensor_type="q8_0", scale=0.3,
                           vocab_size=VOCAB + 200)
    ref = ModelRef(str(gguf), backend="ggml")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(target=ref, draft=ref, mode=mode, launch="local", k=3, max_batch=2, max_model_len=320,
                   plain_under_load=False)
    with LLM(**options, prefix_cache_seqs=0, prefill_chunk=0) as llm:
        expected, _, _ = _outputs(llm, params)
    with LLM(**options, prefix_cache_seqs=2, prefill_chunk=64) as llm:
        got, cached, draft_cached = _outputs(llm, params)
        # llama.cpp's kept prompts wait in host memory: each cache is sized for the running batch.
        assert _executor_sequences(llm) == ((2, 2) if mode != "ar" else (2,))
    assert got == expected
    # The target reuses 64-token tiles leaving at least 64 tokens (or a 512 cut) to prefill.
    assert cached == [0, 64, 128, 0, 64]
    if mode != "ar":
        assert draft_cached == [0, 150, 150, 0, 150]  # the draft's rows need no such care


def test_ggml_ranks_keep_more_prompts_than_their_sequences_by_default(tmp_path_factory):
    """Unset, prefix_cache_seqs keeps as many prompts as prefix_cache_mib holds on llama.cpp ranks
    (a kept prompt waits in host memory): twelve prompts sent in turn all hit when repeated."""
    pytest.importorskip("llama_cpp")
    from ggml_models import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensor_type="q8_0", scale=0.3,
                           vocab_size=VOCAB + 200)
    ref = ModelRef(str(gguf), backend="ggml")
    prompts = [_prompt(40, 300 + i, vocab=VOCAB) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(target=ref, draft=ref, mode="ssd", launch="local", k=3, max_batch=2, max_model_len=128,
             plain_under_load=False) as llm:
        first = [llm.generate([p], params)[0] for p in prompts]
        again = [llm.generate([p], params)[0] for p in prompts]
        assert _executor_sequences(llm) == (2, 2)
    assert [o.num_cached_tokens for o in first] == [0] * 12
    assert [o.num_cached_tokens for o in again] == [39] * 12  # all but the last prompt token
    assert [o.speculation.draft_cached_tokens for o in again] == [39] * 12
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def test_chunked_prefill_interleaves_a_long_prompt_with_running_rounds(tiny_llm):
    """A long prompt arriving beside a running stream is prefilled in pieces, each carried in a
    round of the running stream: the stream's tokens keep coming while it prefills, one per step."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with tiny_llm(mode="ar", prefill_chunk=32, prefix_cache_seqs=0) as llm:
        loop = llm.loop
        runner = loop.new_sequence(_prompt(10, 1, vocab=VOCAB), params)
        loop.add(runner)
        while len(runner.output) < 2:  # its first token, then its first round
            loop.step()
        long = loop.new_sequence(_prompt(200, 2, vocab=VOCAB), dataclasses.replace(params, max_tokens=2))
        loop.add(long)
        steps, tokens_meanwhile = 0, len(runner.output)
        while not long.output:
            loop.step()
            steps += 1
        tokens_meanwhile = len(runner.output) - tokens_meanwhile
        while loop.has_unfinished():
            loop.step()
    assert steps == 7  # 200 tokens in pieces of 32
    assert tokens_meanwhile == 7  # every piece rides in a round, the last one's too (it emits the first token)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_a_burst_of_short_prompts_leaves_a_round_between_the_steps_that_complete_them(tiny_llm, mode):
    """Prompts arriving together whose prefill completes one after another, step after step (each
    step emits first tokens instead of a round): the running stream still gets a round after each
    such step, not only once every prompt is in."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with tiny_llm(mode=mode, max_batch=6, prefill_chunk=32, prefix_cache_seqs=0, plain_under_load=False) as llm:
        loop = llm.loop
        runner = loop.new_sequence(_prompt(10, 1, vocab=VOCAB), params)
        loop.add(runner)
        while len(runner.output) < 2:
            loop.step()
        burst = [loop.new_sequence(_prompt(30, 10 + i, vocab=VOCAB), dataclasses.replace(params, max_tokens=8))
                 for i in range(5)]
        for seq in burst:
            loop.add(seq)
        runner_tokens, first_token_steps = [], 0
        while not all(seq.output for seq in burst):
            before, started = len(runner.output), sum(bool(seq.output) for seq in burst)
            loop.step()
            runner_tokens.append(len(runner.output) - before)
            first_token_steps += sum(bool(seq.output) for seq in burst) > started
    # 30-token prompts in a 32-token budget complete about one per step.
    assert first_token_steps >= 4
    # Never two steps in a row without a token for the running stream.
    assert all(a or b for a, b in zip(runner_tokens, runner_tokens[1:])), runner_tokens


def test_the_round_owed_after_a_prefill_carries_the_next_arrivals_prompt(tiny_llm):
    """A prompt prefilled alone (no running rows to carry it) owes its sequence a round; a request
    arriving meanwhile rides in that round's forward: both get a token from the same step."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with tiny_llm(mode="ar", prefix_cache_seqs=0) as llm:
        loop = llm.loop
        first = loop.new_sequence(_prompt(20, 1, vocab=VOCAB), params)
        loop.add(first)
        loop.step()
        assert len(first.output) == 1 and loop.scheduler.round_owed
        second = loop.new_sequence(_prompt(20, 2, vocab=VOCAB), params)
        loop.add(second)
        loop.step()
        assert (len(first.output), len(second.output)) == (2, 1)
        while loop.has_unfinished():
            loop.step()
