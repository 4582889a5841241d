"""The Hugging Face tokenizer of a model, wherever it lives: an engine directory (its saved
``tokenizer/``), a GGUF file (whose metadata carries the vocabulary, merges and chat template;
transformers rebuilds the tokenizer) or a Hugging Face model directory."""

from __future__ import annotations

import os
from pathlib import Path

from trtssd.models.engine_dir import is_engine_dir, load_manifest

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer at ``path``, or None when the model has none (the tiny random
    models of the tests). Raises FileNotFoundError when ``path`` does not exist."""
    # transformers takes about a second to import: only the processes that tokenize pay for it
    # (the draft rank never does).
    from transformers import AutoTokenizer

    path = Path(path)
    if is_engine_dir(path):
        saved = load_manifest(path)["tokenizer"]
        return None if saved is None else AutoTokenizer.from_pretrained(str(path / saved["path"]))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: expected an engine directory, a Hugging Face model directory or a .gguf file")
    if any((path / name).exists() for name in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(str(path))
    return None
