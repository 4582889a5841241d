"""Turn a ModelRef into an executor and a tokenizer (each rank loads its own model)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trtssd.backends.torch_backend import TorchExecutor
from trtssd.config import ModelRef
from trtssd.devices import resolve_device
from trtssd.models.engine_dir import attach_fused_layers, is_engine_dir, load_draft_model, load_manifest
from trtssd.models.int8_dynamic import quantize_linears_int8
from trtssd.models.loader import load_model
from trtssd.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_executor(ref: ModelRef, max_seqs: int, max_seq_len: int, max_batch_tokens: int | None = None,
                  device: str = "cpu", device_field: str = "device") -> TorchExecutor:
    """max_batch_tokens: most tokens in one forward (a prefill, or a batch's verify/glue/tree).
    device: "cpu", "cuda" or "cuda:N" (weights, KV pool and forwards there); ``device_field``
    names the option it came from in errors (e.g. "draft_device")."""
    dev = resolve_device(device, device_field)
    if is_engine_dir(ref.path):
        return load_side(ref.path, ref.side, max_seqs=max_seqs, max_seq_len=max_seq_len,
                         max_batch_tokens=max_batch_tokens, device=dev)
    return TorchExecutor.from_pretrained(ref.path, dtype=_DTYPES[ref.dtype], max_seqs=max_seqs,
                                         max_seq_len=max_seq_len, max_batch_tokens=max_batch_tokens, device=dev)


# --- engine directories --------------------------------------------------------------------------


def load_side(engine_dir: str | os.PathLike, side: str, *, max_seqs: int = 4, max_seq_len: int = 2048,
              fused: bool = True, device: str | torch.device = "cpu", **executor_options) -> TorchExecutor:
    """One side's executor, as the engine's manifest says it runs: "torch" (the model's own
    weights in the recorded dtype; the target always), "torch-int4" (the int4 self-draft, with
    the compiled few-row layers unless ``fused`` is False; on CUDA its 4-bit groups dequantized,
    see ``load_draft_model``) or "torch-int8" (either side: int8 projections, the entry's
    activation levels). ``device``: where weights, KV pool and forwards live."""
    device = resolve_device(device, "device")
    engine_dir = Path(engine_dir)
    manifest = load_manifest(engine_dir)
    if side not in ("target", "draft"):
        raise ValueError(f"side must be 'target' or 'draft', got {side!r}")
    entry = manifest[side]
    if entry["backend"] == "torch":
        return TorchExecutor.from_pretrained(
            engine_dir / entry["path"], dtype=_DTYPES[entry.get("dtype", "float32")],
            plain_weights=entry.get("plain_weights", True), max_seqs=max_seqs, max_seq_len=max_seq_len,
            device=device, **executor_options,
        )
    if entry["backend"] == "torch-int8":
        # Only the draft takes the compiled layers: the target's one-row decode and its verify
        # must run the same code (a verify wider than the layers' limit would not).
        model = _int8_model(engine_dir / entry["path"], device, entry.get("activation_levels", 1),
                            fused=fused and side == "draft", side=side)
        return TorchExecutor(model, max_seqs=max_seqs, max_seq_len=max_seq_len, **executor_options)
    if entry["backend"] == "torch-int4" and side == "draft":
        # The compiled few-row layers are CPU code: a CUDA draft runs the plain layers.
        model = load_draft_model(engine_dir, manifest, fused=fused and device.type == "cpu", device=device)
        return TorchExecutor(model, max_seqs=max_seqs, max_seq_len=max_seq_len, **executor_options)
    raise ValueError(f"{engine_dir}: unknown {side} backend {entry['backend']!r}; rebuild the engine")


def _int8_model(path: Path, device: torch.device, levels: int, fused: bool, side: str):
    """The model in fp32 with its projections made int8 (trtssd.models.int8_dynamic) and, when
    ``fused``, its compiled few-row layers. The int8 kernel is CPU code: on a GPU the side runs
    its fp32 weights."""
    model = load_model(path, torch.float32, device=device)
    if device.type == "cpu":
        quantize_linears_int8(model, levels)
        if fused:
            attach_fused_layers(model)
    else:
        log.warning("int8 projections are CPU only; the %s runs in fp32 on %s", side, device)
    return model


@dataclass(frozen=True)
class LoadedEngine:
    """Both sides of an engine, loaded in one process (benchmarks, tests; the runtime loads each
    side in its own rank with ``load_side``)."""

    target: TorchExecutor  # as its manifest entry records (fp32, bf16 or int8 projections)
    draft: TorchExecutor  # over the int4 self-draft, or another model in its recorded dtype
    tokenizer: Any  # transformers tokenizer, or None for tokenizer-less test models
    manifest: dict


def load_engine(engine_dir: str | os.PathLike, *, max_seqs: int = 4, max_seq_len: int = 2048,
                fused: bool = True) -> LoadedEngine:
    """Target executor, draft executor, tokenizer and manifest of an engine directory (``fused``:
    see ``load_side``)."""
    engine_dir = Path(engine_dir)
    return LoadedEngine(
        target=load_side(engine_dir, "target", max_seqs=max_seqs, max_seq_len=max_seq_len),
        draft=load_side(engine_dir, "draft", max_seqs=max_seqs, max_seq_len=max_seq_len, fused=fused),
        tokenizer=load_tokenizer(engine_dir),
        manifest=load_manifest(engine_dir),
    )
