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


def encode_text(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids, as every entry point encodes it: no special tokens added (chat
    templates add their own), and BOS for a text that encodes to nothing."""
    return tokenizer.encode(text, add_special_tokens=False) or [tokenizer.bos_token_id or 0]


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt of one assistant turn: the tokenizer's chat template over ``messages`` (and the
    ``tools`` the model may call, OpenAI's definitions, where given).
    Raises ValueError when the model has no template (the template's own errors pass through)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
