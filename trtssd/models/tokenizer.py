"""Hugging Face tokenizers for our checkpoints: from a model directory or from a GGUF file (whose
metadata carries the vocabulary, merges and chat template; transformers rebuilds the tokenizer)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """The transformers tokenizer of a Hugging Face model directory or a ``.gguf`` file."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: expected a Hugging Face model directory or a .gguf file")
    return AutoTokenizer.from_pretrained(str(path))
