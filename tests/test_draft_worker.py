"""The draft worker in-process (no MPI): the hit branch's KV and logits are reused exactly."""

from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_llama
from trtssd.backends.base import chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.config import Mode, Source, SpeculativeConfig
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
