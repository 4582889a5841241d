"""Model code and weight loading against transformers' own implementations (tiny random models)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trtssd.backends.base import chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from trtssd.models.llama import Linear
from trtssd.models.loader import load_config, load_model, read_gguf, unpermute_rows
from tiny_models import TINY_CONFIGS, TOL, build_tiny, hf_logits, randomize

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, build_tiny(request.param, directory), directory


def test_prefill_matches_transformers(tiny):
    kind, hf, directory = tiny
    ex = TorchExecutor.from_pretrained(directory, max_seqs=2, max_seq_len=64)
    tokens = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(1))
    ex.add_sequence(0)
    ours = ex.forward([chain_chunk(0, tokens, 0)])[0]
    ref = hf_logits(hf, tokens)
    assert ref.std() > 1.0, "reference logits too flat for a meaningful comparison"
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert (ours - ref).abs().max() < TOL


def test_bf16_close_to_fp32(tiny):
    kind, hf, directory = tiny
    ex = TorchExecutor.from_pretrained(directory, dtype=torch.bfloat16, max_seqs=1, max_seq_len=64)
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(2))
    ex.add_sequence(0)
    ours = ex.forward([chain_chunk(0, tokens, 0)])[0]
    ref = hf_logits(hf, tokens)
    # bf16 keeps ~3 significant digits; the error grows with logit magnitude.
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_config_from_hf_dir(tiny):
    kind, hf, directory = tiny
    cfg = load_config(directory)
    assert cfg.num_layers == 2 and cfg.vocab_size == 96
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.qkv_bias == (kind in ("llama3", "qwen2"))
    assert cfg.o_bias == (kind == "llama3")
    assert cfg.qk_norm == (kind == "qwen3")
    assert cfg.head_dim == (32 if kind == "qwen3" else 16)


def test_llama3_rope_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = TINY_CONFIGS["llama3"]()
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = ModelConfig.from_hf(hf_cfg.to_dict()).rope.inv_freq(16)
    plain = RopeConfig(theta=10000.0).inv_freq(16)
    assert not torch.allclose(ref, plain)  # the scaling really changes something here
    assert torch.equal(ours, ref)


def test_old_style_rope_config_is_read():
    cfg = ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    })
    assert cfg.rope == RopeConfig(500000.0, "llama3", 32.0, 1.0, 4.0, 8192)
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError) as err:
        load_config(tmp_path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelConfig.from_hf({**TINY_CONFIGS["llama3"]().to_dict(), "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="lacks required keys"):
        ModelConfig.from_hf({"model_type": "qwen2"})


def test_linears_can_be_swapped(tiny):
    """A quantized backend replaces projections by name; the model must route through them."""
    kind, hf, directory = tiny
    model = load_model(directory)
    names = [n for n, _ in model.linears()]
    assert names[:4] == ["layers.0.attn.qkv", "layers.0.attn.o", "layers.0.mlp.gate_up", "layers.0.mlp.down"]
    assert names[-1] == "lm_head" and len(names) == 4 * 2 + 1

    class Zero(torch.nn.Module):
        def forward(self, x):
            return torch.zeros(*x.shape[:-1], 96)

    model.set_linear("lm_head", Zero())
    ex = TorchExecutor(model, max_seqs=1, max_seq_len=16)
    ex.add_sequence(0)
    assert torch.count_nonzero(ex.forward([chain_chunk(0, [1, 2, 3], 0)])[0]) == 0
    with pytest.raises(ValueError, match="unknown linear"):
        model.set_linear("layers.0.attn.q", Zero())


def test_packing_keeps_results(tiny):
    kind, hf, directory = tiny
    plain, packed = load_model(directory), load_model(directory)
    assert packed.pack_linears() == 9
    x = torch.randn(5, max(m.in_features for _, m in plain.linears()))
    for (name, a), (_, b) in zip(plain.linears(), packed.linears()):
        assert isinstance(b, Linear) and b.packed and not a.packed
        assert torch.allclose(a(x[:, : a.in_features]), b(x[:, : b.in_features]), atol=1e-5), name


# -- GGUF --------------------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for llama q/k rows (written independently of our inverse)."""
    out = w.shape[0]
    return w.reshape(heads, 2, out // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf, path: Path, quantize: bool) -> None:
    """The tiny model as a GGUF, the way llama.cpp's converter lays it out (q/k rows interleaved
    for the llama architecture only; Q4_1 for the big matrices when ``quantize``)."""
    import gguf

    cfg = hf.config
    arch = cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges(["t 1"])
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, p in hf.state_dict().items():
        a = p.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            parts = name.split(".")  # model.layers.{i}[.self_attn|.mlp].{x}.{weight|bias}
            key = parts[-2]
            gname = f"blk.{parts[2]}.{names[key]}.{parts[-1]}"
            if arch == "llama" and key == "q_proj":
                a = llama_cpp_permute(a, cfg.num_attention_heads)
            elif arch == "llama" and key == "k_proj":
                a = llama_cpp_permute(a, cfg.num_key_value_heads)
        if quantize and a.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_1),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind,quantize", [("smollm2", False), ("smollm2", True), ("qwen2", True)])
def test_gguf_matches_transformers_gguf_loader(tmp_path, kind, quantize):
    hf = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[kind](), dtype=torch.float32)
    randomize(hf, seed=3)
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(hf, gguf_path, quantize)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    tokens = torch.randint(0, 96, (17,), generator=torch.Generator().manual_seed(4))
    ref = hf_logits(ref_model.eval(), tokens)
    ex = TorchExecutor.from_pretrained(gguf_path, max_seqs=1, max_seq_len=32)
    ex.add_sequence(0)
    ours = ex.forward([chain_chunk(0, tokens, 0)])[0]
    assert (ours - ref).abs().max() < TOL
    if not quantize:  # unquantized, it is the original model exactly
        assert (ours - hf_logits(hf.eval(), tokens)).abs().max() < TOL


def test_unpermute_works_on_raw_quantized_rows(tmp_path):
    """Row un-permutation commutes with dequantization, so quantized backends can apply it to
    the raw Q4_1 blocks."""
    import gguf

    rows = np.random.default_rng(0).standard_normal((24, 64)).astype(np.float32)
    raw = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_1)
    deq = lambda r: gguf.quants.dequantize(r, gguf.GGMLQuantizationType.Q4_1)  # noqa: E731
    assert np.array_equal(deq(unpermute_rows(raw, 3)), unpermute_rows(deq(raw), 3))
    assert np.array_equal(unpermute_rows(llama_cpp_permute(rows, 3), 3), rows)
    assert not np.array_equal(unpermute_rows(rows, 3), rows)


def test_read_gguf_exposes_raw_tensors(tmp_path):
    hf = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS["smollm2"](), dtype=torch.float32)
    write_gguf(hf, tmp_path / "t.gguf", quantize=True)
    g = read_gguf(tmp_path / "t.gguf")
    t = g.tensors["blk.0.attn_q.weight"]
    assert t.qtype.name == "Q4_1" and t.shape == (96, 96) and t.data.dtype == np.uint8
    assert t.data.shape == (96, 96 // 32 * 20)  # 32 weights per 20-byte Q4_1 block
    assert g.metadata["general.architecture"] == "llama"
    assert tuple(t.dequantize().shape) == (96, 96)
    # our header walk agrees with the gguf package's reader on every tensor and scalar
    from gguf import GGUFReader, GGUFValueType

    ref = GGUFReader(tmp_path / "t.gguf")
    scalars = {n: f.contents() for n, f in ref.fields.items()
               if f.types and f.types[0] != GGUFValueType.ARRAY and not n.startswith("GGUF.")}
    assert scalars == g.metadata
    assert [r.name for r in ref.tensors] == list(g.tensors)
    for r in ref.tensors:
        ours = g.tensors[r.name]
        assert ours.qtype == r.tensor_type and ours.data.dtype == r.data.dtype
        assert np.array_equal(ours.data, r.data), r.name
