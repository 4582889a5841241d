"""Turn a ModelRef into an executor and a tokenizer (each rank loads its own model)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from trtssd.backends.ggml_backend import GgmlExecutor
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.config import ModelRef
from trtssd.devices import resolve_device
from trtssd.models.engine_dir import attach_fused_layers, is_engine_dir, load_draft_model, load_manifest
from trtssd.models.config import ModelConfig
from trtssd.models.int8_dynamic import load_int8_model
from trtssd.models.loader import load_model
from trtssd.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_executor(ref: ModelRef, max_seqs: int, max_seq_len: int, max_batch_tokens: int | None = None,
                  device: str = "cpu", device_field: str = "device", row_invariant: bool = True,
                  kept_prompts: int = 0) -> TorchExecutor | GgmlExecutor:
    """max_seqs: sequences running at once. max_batch_tokens: most tokens in one forward (a
    prefill, or a batch's verify/glue/tree). device: "cpu", "cuda" or "cuda:N" (weights, KV pool
    and forwards there); ``device_field`` names the option it came from in errors (e.g.
    "draft_device"). row_invariant: for a ggml model, keep each row's logits independent of its
    batch (the target; the draft need not, see trtssd/backends/ggml_backend.py). kept_prompts:
    finished prompts the prefix cache keeps (see `load_side`)."""
    dev = resolve_device(device, device_field)
    if ref.backend == "ggml":
        return _ggml_executor(ref.path, dev, device_field, max_seqs=max_seqs, max_seq_len=max_seq_len,
                              max_batch_tokens=max_batch_tokens, row_invariant=row_invariant)
    if is_engine_dir(ref.path):
        return load_side(ref.path, ref.side, max_seqs=max_seqs, max_seq_len=max_seq_len,
                         max_batch_tokens=max_batch_tokens, device=dev, row_invariant=row_invariant,
                         kept_prompts=kept_prompts)
    return TorchExecutor.from_pretrained(ref.path, dtype=_DTYPES[ref.dtype], max_seqs=max_seqs + kept_prompts,
                                         max_seq_len=max_seq_len, max_batch_tokens=max_batch_tokens, device=dev)


# --- engine directories --------------------------------------------------------------------------


def load_side(engine_dir: str | os.PathLike, side: str, *, max_seqs: int = 4, max_seq_len: int = 2048,
              fused: bool = True, device: str | torch.device = "cpu", row_invariant: bool = True,
              kept_prompts: int = 0, **executor_options) -> TorchExecutor | GgmlExecutor:
    """One side's executor, as the engine's manifest says it runs: "ggml" (the GGUF file on
    llama.cpp, CPU only), "torch" (the model's own
    weights in the recorded dtype; the target always), "torch-int4" (the int4 self-draft, with
    the compiled few-row layers unless ``fused`` is False; on CUDA its 4-bit groups dequantized,
    see ``load_draft_model``) or "torch-int8" (either side: int8 projections, the entry's
    activation levels). ``device``: where weights, KV pool and forwards live.

    ``max_seqs`` sequences run at once; ``kept_prompts`` finished prompts are kept for the
    prefix cache besides them. A torch executor keeps those as sequences of its own, so its pool
    holds both; llama.cpp's are copied to host memory (`GgmlExecutor.save_prefix`), so its cache
    is sized for the running ones alone."""
    device = resolve_device(device, "device")
    engine_dir = Path(engine_dir)
    manifest = load_manifest(engine_dir)
    if side not in ("target", "draft"):
        raise ValueError(f"side must be 'target' or 'draft', got {side!r}")
    entry = manifest[side]
    if entry["backend"] == "ggml":
        return _ggml_executor(engine_dir / entry["path"], device, "device", max_seqs=max_seqs,
                              max_seq_len=max_seq_len, row_invariant=row_invariant, **executor_options)
    max_seqs += kept_prompts
    if entry["backend"] == "torch":
        return TorchExecutor.from_pretrained(
            engine_dir / entry["path"], dtype=_DTYPES[entry.get("dtype", "float32")],
            plain_weights=entry.get("plain_weights", True), max_seqs=max_seqs, max_seq_len=max_seq_len,
            device=device, **executor_options,
        )
    if entry["backend"] == "torch-int8":
        # Only the draft takes the compiled layers: the target's one-row decode and its verify
        # must run the same code (a verify wider than the layers' limit would not).
        model = _int8_model(engine_dir, manifest, side, device, fused=fused and side == "draft")
        return TorchExecutor(model, max_seqs=max_seqs, max_seq_len=max_seq_len, **executor_options)
    if entry["backend"] == "torch-int4" and side == "draft":
        # The compiled few-row layers are CPU code: a CUDA draft runs the plain layers.
        model = load_draft_model(engine_dir, manifest, fused=fused and device.type == "cpu", device=device)
        return TorchExecutor(model, max_seqs=max_seqs, max_seq_len=max_seq_len, **executor_options)
    raise ValueError(f"{engine_dir}: unknown {side} backend {entry['backend']!r}; rebuild the engine")


def _ggml_executor(path, device: torch.device, device_field: str, **options) -> GgmlExecutor:
    """llama.cpp on the CPU (this build of llama-cpp-python has no GPU backend)."""
    if device.type != "cpu":
        raise ValueError(f"{device_field}: the ggml backend runs on 'cpu' here, got {str(device)!r}; "
                         "build the engine with backend 'torch' for CUDA")
    unknown = sorted(set(options) - {"max_seqs", "max_seq_len", "max_batch_tokens", "row_invariant"})
    if unknown:
        raise ValueError(f"{unknown} are torch-backend options; the ggml backend does not take them")
    return GgmlExecutor(path, **options)


def _int8_model(engine_dir: Path, manifest: dict, side: str, device: torch.device, fused: bool):
    """The side's stored int8 weights, packed (trtssd.models.int8_dynamic), with the compiled
    few-row layers when ``fused``. The int8 kernel is CPU code: on a GPU the side runs its model
    file in fp32."""
    entry = manifest[side]
    if device.type != "cpu":
        log.warning("int8 projections are CPU only; the %s runs in fp32 on %s", side, device)
        return load_model(engine_dir / entry["path"], torch.float32, device=device)
    if "int8_weights" not in entry:
        raise ValueError(f"{engine_dir}: the {side}'s int8 weights are not in the engine (built by an older "
                         "trtssd); rebuild it with `trtssd build`")
    cfg = ModelConfig.from_json(entry["config"] if side == "draft" else manifest["architecture"])
    model = load_int8_model(load_file(str(engine_dir / entry["int8_weights"])), cfg, entry["activation_levels"])
    if fused:
        attach_fused_layers(model)
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
