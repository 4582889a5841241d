"""Int8 projections: close to fp32, each row independent of the rows beside it, engines built with
an int8 draft or an int8 target, and exact speculation on both."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from tiny_models import make_tiny_gguf
from trtssd import LLM, SamplingParams
from trtssd.backends.base import chain_chunk
from trtssd.backends.loading import load_side
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.build import build_engine
from trtssd.models.engine_dir import load_manifest
from trtssd.models.int8_dynamic import Int8DynamicLinear, int8_available, quantize_linears_int8, quantize_weight
from trtssd.models.loader import load_model

pytestmark = pytest.mark.skipif(not int8_available(), reason="torch without a quantized CPU engine")


@pytest.mark.parametrize("levels", [1, 2])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(levels):
    """A target's verify (K+1 rows) must compute what its one-row decode computes, bit for bit."""
    torch.manual_seed(0)
    layer = Int8DynamicLinear.from_weight(torch.randn(96, 64), torch.randn(96), activation_levels=levels)
    x = torch.randn(7, 64)
    x[3] *= 50.0  # one loud row would set a shared activation scale for all
    x[5, 10] = -80.0  # and one outlier value
    together = layer(x)
    for i in range(len(x)):
        assert torch.equal(layer(x[i:i + 1])[0], together[i]), f"row {i}"
    assert torch.equal(layer(x[2:5]), together[2:5])


def test_two_activation_levels_leave_only_the_weights_error():
    torch.manual_seed(0)
    w, b = torch.randn(256, 512), torch.randn(256)
    x = torch.randn(6, 512)
    x[:, 7] *= 40.0  # an outlier channel, as LLM activations have
    ref = x @ w.T + b
    err = {levels: ((Int8DynamicLinear.from_weight(w, b, levels)(x) - ref).norm() / ref.norm()).item() for levels in (1, 2)}
    weights_only = ((x @ _int8_weights(w).T + b - ref).norm() / ref.norm()).item()
    assert err[2] < 0.25 * err[1]
    assert err[2] < 1.05 * weights_only


def _int8_weights(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    return torch.round(w / scale).clamp(-127, 127) * scale


def test_quantize_weight_rounds_as_torchs_per_channel_quantization():
    w = torch.randn(257, 300) * torch.rand(257, 1) * 4
    codes, scales = quantize_weight(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        want = torch.quantize_per_channel(w, scales, torch.zeros(257, dtype=torch.long), 0, torch.qint8)
    assert codes.dtype == torch.int8 and torch.equal(codes, want.int_repr())
    assert torch.equal(scales, want.q_per_channel_scales())


def test_bad_activation_levels_are_rejected():
    with pytest.raises(ValueError, match="activation_levels must be one of"):
        Int8DynamicLinear.from_weight(torch.randn(4, 4), activation_levels=3)


@pytest.mark.parametrize("rows", [1, 6, 40])
def test_int8_linear_is_close_to_fp32(rows):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    layer = Int8DynamicLinear.from_weight(w, b)
    x = torch.randn(2, rows, 64)
    ref = x @ w.T + b
    y = layer(x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    # 8-bit weights per channel and 7-bit activations per row: about 1% of the output's scale.
    assert (y - ref).abs().mean() < 0.02 * ref.abs().mean()


def test_int8_linear_keeps_each_output_channels_scale():
    """A channel of tiny weights beside a channel of huge ones stays accurate (per-channel scales)."""
    w = torch.randn(32, 64)
    w[0] *= 1e-3
    w[1] *= 1e3
    x = torch.randn(4, 64)
    y, ref = Int8DynamicLinear.from_weight(w)(x), x @ w.T
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


@pytest.fixture(scope="module")
def int8_target_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8-target")
    source = make_tiny_gguf(root / "Tiny-Model.gguf")
    return build_engine(source, root / "engines", target_dtype="int8", draft_dtype="int8", name="tiny-int8-target",
                        progress=False)


def test_an_int8_target_runs_two_activation_levels(int8_target_engine):
    manifest = load_manifest(int8_target_engine)
    assert manifest["target"]["backend"] == "torch-int8" and manifest["target"]["activation_levels"] == 2
    assert manifest["draft"]["activation_levels"] == 1
    assert manifest["build"]["recipe"]["target_dtype"] == "int8"
    target = load_side(int8_target_engine, "target", max_seqs=1, max_seq_len=128)
    draft = load_side(int8_target_engine, "draft", max_seqs=1, max_seq_len=128)
    assert {m.activation_levels for _, m in target.model.linears()} == {2}
    assert {m.activation_levels for _, m in draft.model.linears()} == {1}
    assert target.model.fused_layers is None  # one code path for decode and verify


def test_stored_int8_weights_are_the_load_time_quantization_bit_for_bit(int8_target_engine):
    """The engine stores int8 codes so loading only packs them; nothing may change on the way."""
    manifest = load_manifest(int8_target_engine)
    assert manifest["target"]["int8_weights"] == "target/int8.safetensors"
    assert manifest["draft"]["int8_weights"] == "draft/int8.safetensors"
    stored = load_side(int8_target_engine, "target", max_seqs=1, max_seq_len=128, fused=False)
    fresh = load_model(int8_target_engine / manifest["target"]["path"], torch.float32)
    quantize_linears_int8(fresh, activation_levels=2)
    logits = []
    for ex in (stored, TorchExecutor(fresh, max_seqs=1, max_seq_len=128)):
        ex.add_sequence(0)
        logits.append(ex.forward([chain_chunk(0, list(range(5, 40)), 0)])[0])
    got, want = logits
    assert torch.equal(got, want)


def test_an_engine_without_stored_int8_weights_says_rebuild(int8_target_engine, tmp_path):
    old = tmp_path / "old-engine"
    shutil.copytree(int8_target_engine, old)
    manifest = load_manifest(old)
    del manifest["target"]["int8_weights"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="int8 weights are not in the engine.*rebuild it"):
        load_side(old, "target", max_seqs=1, max_seq_len=128)


@pytest.mark.parametrize("engine_fixture", ["int8_engine", "int8_target_engine"])
def test_speculation_on_int8_projections_equals_plain_greedy(engine_fixture, request):
    engine = request.getfixturevalue(engine_fixture)
    prompts = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45], [9] * 12, [70, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = {}
    for mode in ("ar", "sd", "ssd"):
        with LLM(str(engine), mode=mode, launch="local", max_model_len=128) as llm:
            outputs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["sd"] == outputs["ar"] and outputs["ssd"] == outputs["ar"]


def test_an_unknown_target_dtype_is_a_clear_error(tmp_path):
    source = make_tiny_gguf(tmp_path / "Tiny-Model.gguf")
    with pytest.raises(ValueError, match=r"target_dtype must be one of \('float32', 'bfloat16', 'int8'\)"):
        build_engine(source, tmp_path / "engines", target_dtype="int4", progress=False)
