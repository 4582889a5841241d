"""Turn a ModelRef into an executor and a tokenizer (each rank loads its own model)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from trtssd.config import ModelRef

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def is_engine_dir(path: str | Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def resolve_models(engine: str | None, target: ModelRef | None, draft: ModelRef | None) -> tuple[ModelRef, ModelRef]:
    """The (target, draft) pair to load: explicit refs, an engine directory, or the default."""
    if target is not None:
        if engine is not None:
            raise ValueError("give either engine or target/draft, not both")
        return target, draft if draft is not None else target
    if draft is not None:
        raise ValueError("a draft ModelRef needs a target ModelRef too")
    if engine is None:
        from trtssd.build import default_engine

        engine = str(default_engine())
    if not is_engine_dir(engine):
        raise ValueError(f"engine {engine!r} is not an engine directory (no manifest.json); build one with `trtssd build`")
    return ModelRef(engine, "target"), ModelRef(engine, "draft")


def load_executor(ref: ModelRef, max_seqs: int, max_seq_len: int, max_batch_tokens: int | None = None):
    """max_batch_tokens: most tokens in one forward (a prefill, or a batch's verify/glue/tree)."""
    if is_engine_dir(ref.path):
        from trtssd.build import load_side

        return load_side(ref.path, ref.side, max_seqs=max_seqs, max_seq_len=max_seq_len,
                         max_batch_tokens=max_batch_tokens)
    from trtssd.backends.torch_backend import TorchExecutor

    return TorchExecutor.from_pretrained(ref.path, dtype=_DTYPES[ref.dtype], max_seqs=max_seqs,
                                         max_seq_len=max_seq_len, max_batch_tokens=max_batch_tokens)


def load_tokenizer(ref: ModelRef):
    """The Hugging Face tokenizer of a model, or None for tokenizer-less test models."""
    path = Path(ref.path)
    if is_engine_dir(path):
        from trtssd.build import load_engine_tokenizer

        return load_engine_tokenizer(path)
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return AutoTokenizer.from_pretrained(str(path))
    return None
