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
