"""An engine directory as the loaders see it: its layout, its manifest and its int4 draft model.

``trtssd.build`` writes engine directories (the layout is described there); this module reads
them, and the executors on top of them are made by ``trtssd.backends.loading``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file

from trtssd.kernels.draft_layers import FusedDraftLayers
from trtssd.models.config import ModelConfig
from trtssd.models.llama import LlamaModel
from trtssd.models.quant import DENSE_ABOVE_ROWS, Int4Groups, quantize_linears, unpack_nibbles, use_int4_kernel

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the directory layout or a stored tensor's meaning changes
MANIFEST = "manifest.json"
TARGET_DIR = "target"  # a Hugging Face target is this directory (config.json + safetensors)
TARGET_FILE = "target/model.gguf"  # a GGUF target
DRAFT_DIR = "draft"  # a Hugging Face draft run by torch
DRAFT_GGUF = "draft/model.gguf"  # a GGUF draft run by torch
DRAFT_FILE = "draft/model.safetensors"  # the int4 self-draft
TARGET_INT8 = "target/int8.safetensors"  # a target run with int8 projections: its stored weights
DRAFT_INT8 = "draft/int8.safetensors"  # same for a separate draft
TOKENIZER_DIR = "tokenizer"


def is_engine_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).is_file()


def load_manifest(engine_dir: str | os.PathLike) -> dict:
    path = Path(engine_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{engine_dir} is not an engine directory (no {MANIFEST}); build one with `trtssd build`")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: engine format_version {manifest.get('format_version')!r}, this trtssd reads {FORMAT_VERSION}; rebuild it"
        )
    return manifest


def engine_speculation(path: str | os.PathLike) -> dict[str, Any]:
    """The speculation defaults tuned for an engine (its manifest's ``speculation``: K, fan-out
    budget, ...); empty for a model that is not an engine directory, or an engine without them."""
    if not is_engine_dir(path):
        return {}
    section = load_manifest(path).get("speculation") or {}
    if not isinstance(section, dict):
        raise ValueError(f"{Path(path) / MANIFEST}: 'speculation' must be an object; got {section!r}")
    return section


def load_draft_model(engine_dir: str | os.PathLike, manifest: Mapping[str, Any] | None = None, *,
                     fused: bool = True, device: str | torch.device = "cpu") -> LlamaModel:
    """The draft ``LlamaModel`` with Int4Linear projections, from an engine directory. ``fused``:
    run few-row forwards through the compiled layers (trtssd.kernels.draft_layers; compiled on
    first use); when they cannot be built the torch layers are used and a warning says why.

    ``device`` other than the CPU: the int4 kernel (aten._weight_int4pack_mm_for_cpu) is CPU
    only, so the same 4-bit groups are dequantized to fp32 plain projections on the device (the
    head then uses its exact weight instead of int4 + top-k re-scoring). The draft's distribution
    changes slightly; verification keeps the output exact. Unverified: never run on a GPU."""
    engine_dir = Path(engine_dir)
    manifest = manifest if manifest is not None else load_manifest(engine_dir)
    draft = manifest["draft"]
    if draft["backend"] != "torch-int4":
        raise ValueError(f"{engine_dir}: the draft is {draft['backend']!r}, not the int4 self-draft")
    cfg = ModelConfig.from_json(draft["config"])
    stored = load_file(str(engine_dir / draft["path"]))
    model = LlamaModel(cfg)
    groups = {}
    for name, _ in model.linears():
        try:
            groups[name] = Int4Groups(
                unpack_nibbles(stored[f"int4.{name}.codes"]),
                stored[f"int4.{name}.scales"].float(),
                stored[f"int4.{name}.mins"].float(),
            )
        except KeyError as err:
            raise ValueError(f"{engine_dir / draft['path']}: missing tensor {err}; rebuild the engine") from None
    params = {k[len("param."):]: v for k, v in stored.items() if k.startswith("param.")}
    device = torch.device(device)
    if device.type != "cpu":
        return _dequantized_draft(cfg, groups, params, device)
    quantize_linears(model, groups, head_top_k=draft["head_top_k"], dense_above=DENSE_ABOVE_ROWS)
    model.load_weights(params)
    if fused:
        attach_fused_layers(model)
    return model.eval()


def _dequantized_draft(cfg: ModelConfig, groups: Mapping[str, Int4Groups], params: Mapping[str, torch.Tensor],
                       device: torch.device) -> LlamaModel:
    """The int4 draft as a plain fp32 model on ``device``: each projection the exact dequantized
    4-bit groups, the head its stored exact weight (or the tied embedding)."""
    with torch.device(device):
        model = LlamaModel(cfg)
    weights = {f"{name}.weight": g.dequantize() for name, g in groups.items() if name != "lm_head"}
    state = {**params, **weights}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the head is the embedding
    elif "lm_head.weight" not in state:
        state["lm_head.weight"] = groups["lm_head"].dequantize()
    model.load_weights(state)
    return model.eval()


def attach_fused_layers(model: LlamaModel) -> None:
    """Give an int4 or int8 draft its compiled few-row layers, and every int4 projection (the
    head's too) the compiled int4 matmul they use; or say why it runs without them."""
    try:
        model.fused_layers = FusedDraftLayers.from_model(model)
    except Exception as err:  # noqa: BLE001 - a speed-up only: the torch layers compute the same
        log.warning("draft runs on the torch layers only; fused draft layers unavailable: %s", err)
        return
    use_int4_kernel(model)
