"""Tiny random-weight models for tests: Llama checkpoints (a target and a perturbed draft), one
configuration per supported architecture, and a SmolLM2-shaped GGUF with its tokenizer."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers


def make_tiny_llama(path: Path, seed: int, vocab: int = 64, hidden: int = 32, layers: int = 2,
                    base: Path | None = None, noise: float = 0.0) -> Path:
    """Save a tiny Llama to ``path``. With ``base``, copy its weights plus Gaussian noise so the
    draft agrees with the target often but not always (like a real draft)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        if base is not None:
            ref = transformers.LlamaForCausalLM.from_pretrained(base)
            for p, q in zip(model.parameters(), ref.parameters()):
                p.copy_(q + noise * torch.randn_like(q))
    model.save_pretrained(path)
    return path


def make_tiny_pair(root: Path) -> tuple[Path, Path]:
    """The runtime tests' default pair: a tiny target and a draft that mostly agrees with it."""
    target = make_tiny_llama(root / "target", seed=0)
    return target, make_tiny_llama(root / "draft", seed=1, base=target, noise=0.05)


def tiny_int4_pair(cfg, top_k: int = 0, seed: int = 0, **executor_options):
    """(int4 executor, fp32 executor) over identical random weights of config ``cfg``: the fp32
    model holds exactly the dequantized 4-bit groups, so only the int4 path's arithmetic differs.
    The same seed gives the same weights, so two calls give interchangeable int4 models."""
    from trtssd.backends.torch_backend import TorchExecutor
    from trtssd.models.llama import LlamaModel
    from trtssd.models.quant import groups_from_float, quantize_linears

    gen = torch.Generator().manual_seed(seed)
    ref = LlamaModel(cfg)
    groups = {name: groups_from_float(torch.randn(m.out_features, m.in_features, generator=gen) * 0.2)
              for name, m in ref.linears()}
    plain = {"embed.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen),
             "norm.weight": 1 + 0.1 * torch.randn(cfg.hidden_size, generator=gen)}
    for i in range(cfg.num_layers):
        for norm in ("attn_norm", "mlp_norm"):
            plain[f"layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(cfg.hidden_size, generator=gen)
    for name, m in ref.linears():
        if getattr(m, "bias", None) is not None:
            plain[f"{name}.bias"] = 0.5 * torch.randn(m.out_features, generator=gen)
    dequantized = {f"{name}.weight": g.dequantize() for name, g in groups.items()}
    ref.load_weights({**plain, **dequantized})
    draft = quantize_linears(LlamaModel(cfg), groups, head_top_k=top_k)
    draft.load_weights({**plain, "lm_head.weight": dequantized["lm_head.weight"]})
    kw = {"max_seqs": 2, "max_seq_len": 64, **executor_options}
    return TorchExecutor(draft.eval(), **kw), TorchExecutor(ref.eval(), **kw)


def tiny_int8_pair(cfg, seed: int = 0, activation_levels: int = 1, **executor_options):
    """(int8 executor, fp32 executor): the fp32 model of ``tiny_int4_pair`` and another copy of
    it whose projections were made Int8DynamicLinear. The same seed gives the same weights."""
    from trtssd.models.int8_dynamic import quantize_linears_int8

    _, ref = tiny_int4_pair(cfg, seed=seed, **executor_options)
    _, int8 = tiny_int4_pair(cfg, seed=seed, **executor_options)
    quantize_linears_int8(int8.model, activation_levels)  # from the plain fp32 weights the executor keeps
    return int8, ref


TOL = 1e-4  # max abs logit difference allowed against transformers in fp32

_COMMON = dict(vocab_size=96, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)
TINY_CONFIGS = {
    # Llama 3: llama3 RoPE scaling (small original context so every band is exercised), GQA,
    # biased attention projections, untied output.
    "llama3": lambda: transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        tie_word_embeddings=False, **_COMMON,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    # SmolLM2-like: llama, 3:1 GQA, tied embeddings, large theta.
    "smollm2": lambda: transformers.LlamaConfig(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, **_COMMON,
    ),
    # Qwen2: q/k/v bias, tied embeddings.
    "qwen2": lambda: transformers.Qwen2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **_COMMON,
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim != hidden / heads, untied.
    "qwen3": lambda: transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        **_COMMON,
    ),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits spread over several units (so a 1e-4 check means
    something) and non-trivial norms and biases (their defaults, ones and zeros, hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 1.5 / p.shape[1] ** 0.5)


def build_tiny(kind: str, directory: Path, seed: int = 0):
    """A random tiny transformers model of ``kind`` saved to ``directory``; returns it (eval)."""
    model = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[kind](), dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(directory)
    return model.eval()


def hf_logits(model, tokens) -> torch.Tensor:
    """transformers' logits for every prefix of ``tokens`` (the reference for all comparisons)."""
    with torch.no_grad():
        return model(torch.as_tensor(tokens)[None]).logits[0].float()


Q4_1, Q8_0, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
MERGES = ["Ġ t", "Ġ a", "i n", "h e"]


def _byte_chars() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def make_tiny_gguf(path: Path, seed: int = 0, merges: list[str] = MERGES, layers: int = 2) -> Path:
    """A random llama GGUF laid out like SmolLM2's: Q4_1 projections, tied Q8_0 embedding,
    fp32 norms, and a byte-level BPE tokenizer."""
    tokens = ["<|endoftext|>", *_byte_chars(), *(m.replace(" ", "") for m in MERGES)]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    rng = np.random.default_rng(seed)

    def add(name: str, shape: tuple[int, ...], qtype, scale: float = 0.15, offset: float = 0.0) -> None:
        values = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if qtype == F32:
            w.add_tensor(name, values)
        else:
            raw = gguf.quants.quantize(values, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), 64), Q8_0, scale=1.0)
    add("output_norm.weight", (64,), F32, scale=0.1, offset=1.0)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (64,), F32, scale=0.1, offset=1.0)
        add(f"blk.{i}.ffn_norm.weight", (64,), F32, scale=0.1, offset=1.0)
        for name, shape in (("attn_q", (64, 64)), ("attn_k", (32, 64)), ("attn_v", (32, 64)), ("attn_output", (64, 64)),
                            ("ffn_gate", (128, 64)), ("ffn_up", (128, 64)), ("ffn_down", (64, 128))):
            add(f"blk.{i}.{name}.weight", shape, Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
