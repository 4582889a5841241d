"""The draft worker in-process (no MPI): the hit branch's KV and logits are reused exactly."""

from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_llama
from trtssd.backends.base import chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.config import Mode, ModelRef, RuntimeConfig, Source, SpeculativeConfig
from trtssd.runtime.draft_rank import load_worker
from trtssd.runtime.draft_worker import DraftWorker
from trtssd.runtime.protocol import Outcome, Prefill, SpeculateRequest
from trtssd.sampling import SamplingParams

K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("draft") / "m", seed=3)


def _executor(path) -> TorchExecutor:
    return TorchExecutor.from_pretrained(path, max_seqs=2, max_seq_len=256)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_glue_on_a_hit_reuses_the_branch_and_matches_a_fresh_decode(model_dir, temperature):
    worker = DraftWorker(_executor(model_dir), SpeculativeConfig(mode=Mode.SSD, k=K, fanout=(1, 1, 1, 2)))
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=100)
    prompt = [1, 2, 3, 4, 5, 6]
    worker.prefill(Prefill(0, tuple(prompt), params))
    captured = {}
    glue = worker._glue

    def spy(seqs):
        captured["adopt"] = [s.hit is not None and not s.uncached for s in seqs]
        captured["rows"] = glue(seqs)
        return captured["rows"]

    worker._glue = spy
    outcome = Outcome(0, 0, 7)
    hits = 0
    for round_id in range(6):
        ans = worker.answer(SpeculateRequest(round_id, (outcome,), round_id % 2, 0.01, ()))
        hits += ans.sources[0] is Source.HIT
        worker.prespeculate()
        seq = worker.seqs[0]
        # Every glue, adopted or decoded, must equal decoding the whole history afresh.
        ref = _executor(model_dir)
        ref.add_sequence(0)
        tokens = seq.history + seq.last_spec
        want = ref.forward([chain_chunk(0, tokens, 0)])[0][-(K + 1):]
        assert (captured["rows"][0] - want).abs().max() < 1e-4
        # Next outcome: the deepest cached fork (a hit, so the next glue adopts its branch).
        keys = sorted(worker.cache[0].entries, key=lambda key: -key[0])
        outcome = Outcome(0, *keys[0])
    assert hits == 5 and captured["adopt"] == [True]


def test_auto_fanout_prices_the_tree_by_tree_steps(model_dir):
    """A tree step attends through a mask and samples every branch, so it costs more than a chain
    forward of as many rows. The width must be chosen from what tree steps cost (on the Qwen pair,
    pricing them as chain forwards grew the tree past the verify window: the target waited)."""
    worker = DraftWorker(_executor(model_dir), SpeculativeConfig(mode=Mode.SSD, k=K, fanout="auto", fanout_budget=12))
    worker.calibrate(context=16, max_rows=16)
    assert [n for n, _ in worker.tree_costs.curve().points] == [1, 2, 4, 8, 16]  # tree steps, not the prior
    chain = {1: 0.060, 2: 0.061, 4: 0.064, 8: 0.080, 16: 0.110}
    worker.costs.observe("verify_s", 0.37)
    worker.forward_costs.calibrate(chain)
    worker.tree_costs.calibrate(chain)
    cheap_tree = worker._choose_tree_budget(1)
    worker.tree_costs.calibrate({1: 0.057, 2: 0.073, 4: 0.085, 8: 0.133, 16: 0.230})  # measured on the Qwen draft
    dear_tree = worker._choose_tree_budget(1)
    assert dear_tree < cheap_tree
    # Tree steps feed the tree's costs only: the chain curve still prices the glue and backups.
    before = worker.forward_costs.scale
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=50)
    worker.prefill(Prefill(0, (1, 2, 3, 4, 5), params))
    worker.answer(SpeculateRequest(0, (Outcome(0, 0, 7),), 0, 0.37, ()))
    tree_scale = worker.tree_costs.scale
    worker.prespeculate()
    assert worker.tree_costs.scale != tree_scale
    assert worker.forward_costs.scale != before  # the glue's forward


def _first_round(model_dir, params: SamplingParams, first_tree: bool):
    """A new sequence's first answer (outcome: the draft's own top guess of the first token),
    with or without the first token's tree made before it; returns (worker, answer)."""
    worker = DraftWorker(_executor(model_dir), SpeculativeConfig(mode=Mode.SSD, k=K, fanout="auto", fanout_budget=3))
    worker.prefill(Prefill(0, (1, 2, 3, 4, 5, 6), params))
    first = int(worker._first[0].argmax())
    if first_tree:
        assert worker.prespeculate_first_tokens() == 1
        assert not worker._first  # made once
    return worker, worker.answer(SpeculateRequest(0, (Outcome(0, 0, first),), 0, 0.01, ()))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_first_round_hits_the_tree_made_during_prefill(model_dir, temperature):
    """SSD for the first round: while the target prefills, the draft forks its guesses of the
    first token and drafts after each. The first answer is then a hit, with the proposals a
    just-in-time draft would have made (seeded: the same stream for the same outcome), and the
    glue after it adopts the branch exactly."""
    params = SamplingParams(temperature=temperature, seed=9, max_tokens=100)
    _, jit = _first_round(model_dir, params, first_tree=False)
    worker, hit = _first_round(model_dir, params, first_tree=True)
    assert jit.sources == [Source.NEURAL] and hit.sources == [Source.HIT]
    assert torch.equal(hit.tokens, jit.tokens)
    if temperature:
        assert (hit.probs - jit.probs).abs().max() < 1e-5
    glue = worker._glue
    captured = {}

    def spy(seqs):
        captured["adopt"] = seqs[0].hit is not None
        captured["rows"] = glue(seqs)
        return captured["rows"]

    worker._glue = spy
    worker.prespeculate()
    seq = worker.seqs[0]
    ref = _executor(model_dir)
    ref.add_sequence(0)
    want = ref.forward([chain_chunk(0, seq.history + seq.last_spec, 0)])[0][-(K + 1):]
    assert captured["adopt"] and (captured["rows"][0] - want).abs().max() < 1e-4


def test_a_first_round_asked_before_its_tree_is_a_backup(model_dir):
    """The target's request came first (the draft was not idle): no tree is made afterwards."""
    worker, ans = _first_round(model_dir, SamplingParams(temperature=0, max_tokens=100), first_tree=False)
    assert ans.sources == [Source.NEURAL]
    assert worker.prespeculate_first_tokens() == 0


def test_start_up_calibration_stops_at_the_widest_tree_of_the_configuration(model_dir):
    """Timing 64-row forwards costs seconds of start-up (4 of the 11.6 s the SmolLM2 draft took)
    that a configuration of one sequence and 2 branches a round would never use."""
    spec = SpeculativeConfig(mode=Mode.SSD, k=K, fanout="auto", fanout_budget=2)
    worker = load_worker(ModelRef(str(model_dir)), spec, RuntimeConfig(max_batch=1), max_seq_len=256)
    assert [n for n, _ in worker.tree_costs.curve().points] == [1, 2, 4]  # K + 1 = 4 glue rows
    assert [n for n, _ in worker.forward_costs.curve().points] == [1, 2, 4]
