"""Tiny random-weight Llama checkpoints for runtime tests (a target and a perturbed draft)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(path: Path, seed: int, vocab: int = 64, hidden: int = 32, layers: int = 2,
                    base: Path | None = None, noise: float = 0.0) -> Path:
    """Save a tiny Llama to ``path``. With ``base``, copy its weights plus Gaussian noise so the
    draft agrees with the target often but not always (like a real draft)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        if base is not None:
            ref = LlamaForCausalLM.from_pretrained(base)
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
