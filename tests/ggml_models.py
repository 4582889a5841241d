"""Tiny random-weight GGUF models that llama.cpp loads and runs (for the ggml backend's tests).

``write_tiny_gguf`` writes a llama or qwen2 GGUF with seeded random weights and a synthetic
SentencePiece-style vocabulary (tests feed token ids, never text). ``tiny_gguf_config`` is the
matching Hugging Face ``config.json`` dict and ``tiny_gguf_tensors`` the float32 weights before
quantization, keyed by GGUF tensor name, so tests can assert shapes or compute references.

Layout conventions (as llama.cpp's convert_hf_to_gguf.py writes them): a numpy array is written
as is and its shape is ggml's ``ne`` reversed, so a Linear weight ``[out, in]`` is stored as
numpy ``[out, in]`` (ne = {in, out}) and the embedding as ``[vocab, hidden]``. The q/k rows are
not permuted: the weights are random, so there is no Hugging Face original to match.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

ARCHES = ("llama", "qwen2")
TENSOR_TYPES = ("f32", "q8_0")

# The synthetic vocabulary: three specials, then the 256 byte tokens "<0x00>".."<0xFF>" when the
# vocabulary has room for them (llama.cpp's SPM vocab looks up "<0x0A>" for its newline token and
# only warns without it), then normal tokens "t{i}".
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
RMS_EPS = 1e-5
ROPE_THETA = 10000.0
_FIRST_BYTE = 3


def _shapes(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int,
            intermediate: int, arch: str) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (ggml ne reversed), in writing order."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    head_dim = hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab_size, hidden)}
    for i in range(layers):
        b = f"blk.{i}"
        shapes[f"{b}.attn_norm.weight"] = (hidden,)
        shapes[f"{b}.attn_q.weight"] = (q, hidden)
        shapes[f"{b}.attn_k.weight"] = (kv, hidden)
        shapes[f"{b}.attn_v.weight"] = (kv, hidden)
        if arch == "qwen2":
            shapes[f"{b}.attn_q.bias"] = (q,)
            shapes[f"{b}.attn_k.bias"] = (kv,)
            shapes[f"{b}.attn_v.bias"] = (kv,)
        shapes[f"{b}.attn_output.weight"] = (hidden, q)
        shapes[f"{b}.ffn_norm.weight"] = (hidden,)
        shapes[f"{b}.ffn_gate.weight"] = (intermediate, hidden)
        shapes[f"{b}.ffn_up.weight"] = (intermediate, hidden)
        shapes[f"{b}.ffn_down.weight"] = (hidden, intermediate)
    shapes["output_norm.weight"] = (hidden,)
    shapes["output.weight"] = (vocab_size, hidden)
    return shapes


def tiny_gguf_tensors(*, arch: str = "llama", vocab_size: int = 512, hidden: int = 64, layers: int = 2,
                      heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                      seed: int = 0, scale: float = 0.02) -> dict[str, np.ndarray]:
    """The float32 weights ``write_tiny_gguf`` writes (before any quantization), by GGUF name:
    matrices and biases N(0, scale), norms ones. The same arguments give the same arrays."""
    if arch not in ARCHES:
        raise ValueError(f"arch {arch!r} not supported; supported: {ARCHES}")
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in _shapes(vocab_size, hidden, layers, heads, kv_heads, intermediate, arch).items():
        if "_norm." in name:
            out[name] = np.ones(shape, dtype=np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return out


def tiny_gguf_config(*, arch: str = "llama", vocab_size: int = 512, hidden: int = 64, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 128, context: int = 2048,
                     seed: int = 0, tensor_type: str = "f32") -> dict[str, Any]:
    """The Hugging Face config.json dict matching ``write_tiny_gguf`` with the same arguments
    (``ModelConfig.from_hf`` accepts it). ``seed`` and ``tensor_type`` do not change it."""
    if arch not in ARCHES:
        raise ValueError(f"arch {arch!r} not supported; supported: {ARCHES}")
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r} not supported; supported: {TENSOR_TYPES}")
    return {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": context,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }


def _vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    if vocab_size >= _FIRST_BYTE + 256:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [TokenType.BYTE] * 256
    tokens += [f"t{i}" for i in range(len(tokens), vocab_size)]
    types += [TokenType.NORMAL] * (vocab_size - len(types))
    scores = [0.0] * _FIRST_BYTE + [-float(i) for i in range(_FIRST_BYTE, vocab_size)]
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(path: str | Path, *, arch: str = "llama", vocab_size: int = 512, hidden: int = 64,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                    context: int = 2048, seed: int = 0, tensor_type: str = "f32", scale: float = 0.02,
                    noise: float = 0.0, noise_seed: int = 1) -> Path:
    """Write a random-weight GGUF of ``arch`` ("llama" or "qwen2") to ``path`` and return it.

    ``tensor_type`` "f32" keeps every tensor float32; "q8_0" stores the 2-D matrices (embedding,
    projections, output) as Q8_0 (their rows, ``hidden`` and ``intermediate``, must divide by 32)
    and keeps norms and biases float32, as llama.cpp's own quantizer does. ``scale`` is the
    weights' standard deviation: at 0.02 the logits are small (std about 0.2), so a test that
    needs a decisive argmax may want a larger one. ``noise``: Gaussian noise of this standard
    deviation (drawn with ``noise_seed``) added to every tensor, so a draft written with the
    target's ``seed`` agrees with it often but not always.

    llama.cpp needs: tokenizer.ggml.model and tokenizer.ggml.tokens (the vocabulary), and
    {arch}.context_length, .embedding_length, .block_count, .feed_forward_length,
    .attention.head_count, .attention.layer_norm_rms_eps; head_count_kv defaults to head_count.
    A "gpt2" (BPE) vocabulary would also need tokenizer.ggml.merges, which gguf-py does not write
    when empty, hence the SentencePiece ("llama") one."""
    import gguf
    from gguf import GGMLQuantizationType, LlamaFileType

    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r} not supported; supported: {TENSOR_TYPES}")
    if vocab_size <= _FIRST_BYTE:
        raise ValueError(f"vocab_size={vocab_size} must exceed the {_FIRST_BYTE} special tokens")
    quantized = tensor_type == "q8_0"
    if quantized and (hidden % 32 or intermediate % 32):
        raise ValueError("q8_0 needs hidden and intermediate divisible by 32 (its block size)")
    tensors = tiny_gguf_tensors(arch=arch, vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads,
                                kv_heads=kv_heads, intermediate=intermediate, seed=seed, scale=scale)
    if noise:
        rng = np.random.default_rng(noise_seed)
        tensors = {name: (v + noise * rng.standard_normal(v.shape)).astype(v.dtype) for name, v in tensors.items()}
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{tensor_type}-seed{seed}")
    w.add_file_type(LlamaFileType.MOSTLY_Q8_0 if quantized else LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(vocab_size)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_freq_base(ROPE_THETA)
    tokens, scores, types = _vocab(vocab_size)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for name, values in tensors.items():
        if quantized and values.ndim == 2:
            raw = gguf.quants.quantize(values, GGMLQuantizationType.Q8_0)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
