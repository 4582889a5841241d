"""The int8 draft: projections close to fp32, engines built with it, and exact speculation on it."""

from __future__ import annotations

import pytest
import torch

from test_build import make_tiny_gguf
from trtssd import LLM, SamplingParams
from trtssd.backends.base import chain_chunk
from trtssd.backends.loading import load_side
from trtssd.build import build_engine
from trtssd.models.engine_dir import load_manifest
from trtssd.models.int8_dynamic import Int8DynamicLinear, int8_available

pytestmark = pytest.mark.skipif(not int8_available(), reason="torch without a quantized CPU engine")


@pytest.mark.parametrize("rows", [1, 6, 40])
def test_int8_linear_is_close_to_fp32(rows):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    layer = Int8DynamicLinear(w, b)
    x = torch.randn(2, rows, 64)
    ref = x @ w.T + b
    y = layer(x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    # 8-bit weights per channel and 7-bit activations per call: about 1% of the output's scale.
    assert (y - ref).abs().mean() < 0.02 * ref.abs().mean()


def test_int8_linear_keeps_each_output_channels_scale():
    """A channel of tiny weights beside a channel of huge ones stays accurate (per-channel scales)."""
    w = torch.randn(32, 64)
    w[0] *= 1e-3
    w[1] *= 1e3
    x = torch.randn(4, 64)
    y, ref = Int8DynamicLinear(w)(x), x @ w.T
    assert torch.allclose(y[:, 0], ref[:, 0], rtol=0.05, atol=0.05 * ref[:, 0].abs().max().item())


@pytest.fixture(scope="module")
def int8_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    source = make_tiny_gguf(root / "Tiny-Model.gguf")
    return build_engine(source, root / "engines", draft_dtype="int8", name="tiny-int8", progress=False)


def test_an_int8_engine_runs_its_draft_in_int8(int8_engine):
    manifest = load_manifest(int8_engine)
    assert manifest["draft"]["backend"] == "torch-int8" and manifest["draft"]["path"] == "draft/model.gguf"
    draft = load_side(int8_engine, "draft", max_seqs=1, max_seq_len=128)
    target = load_side(int8_engine, "target", max_seqs=1, max_seq_len=128)
    assert all(isinstance(m, Int8DynamicLinear) for _, m in draft.model.linears())
    ids = list(range(5, 60))
    logits = []
    for ex in (target, draft):
        ex.add_sequence(0)
        logits.append(ex.forward([chain_chunk(0, ids, 0)])[0].float())
        ex.release(0)
    # The self-draft in int8 against its own fp32 weights.
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9


def test_speculation_on_an_int8_draft_equals_plain_greedy(int8_engine):
    prompts = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for mode in ("ar", "sd", "ssd"):
        with LLM(str(int8_engine), mode=mode, launch="local", max_seq_len=128) as llm:
            outputs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["sd"] == outputs["ar"] and outputs["ssd"] == outputs["ar"]
