"""Weights for ``LlamaModel`` from a Hugging Face directory (config.json + safetensors) or a GGUF file.

Both formats go through one plan: for every parameter of our layout, the checkpoint tensors that
make it (concatenated along rows: q|k|v and gate|up are fused) and whether their rows must be
un-permuted. llama.cpp's converter interleaves the rows of each q/k head for the ``llama``
architecture (its RoPE rotates adjacent pairs; ours, like transformers', rotates the two halves);
``unpermute_rows`` undoes that. It is a pure row permutation, so it applies to raw quantized rows
as well: a quantized backend can take ``read_gguf(...).tensors`` and ``gguf_sources(config)`` and
build its own layers from the original blocks.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

import numpy as np
import torch

from trtssd.models.config import ModelConfig
from trtssd.models.dequant import dequantize
from trtssd.models.llama import LinearFactory, LlamaModel, default_linear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor feeding (part of) one of our parameters."""

    name: str  # tensor name inside the checkpoint
    unpermute_heads: int | None = None  # GGUF llama q/k: heads whose rows llama.cpp interleaved


@dataclass(frozen=True)
class GGUFTensor:
    """A GGUF tensor as stored: quantized blocks are left untouched."""

    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows first): [out_features, in_features] for matrices
    data: np.ndarray  # [rows, bytes per row] uint8 for block-quantized types, else [rows, cols] floats

    def dequantize(self) -> torch.Tensor:
        """fp32 tensor of ``shape``."""
        return dequantize(self.data, self.qtype, self.shape)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # scalar and string key/values; arrays only when asked for (read_gguf)
    tensors: dict[str, GGUFTensor]


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"


# GGUF value types (the format's numbering): scalar struct codes, 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# Unquantized tensor types read as typed arrays; everything else stays raw bytes per row.
_GGUF_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


class _Cursor:
    """Sequential little-endian reads over the GGUF header."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, code: str):
        if self.pos + struct.calcsize("<" + code) > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header")
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize("<" + code)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_array: bool = False):
        """A value of ``vtype``. Arrays are skipped (None) unless ``keep_array``: loading a model
        needs only scalars; the engine build also reads the tokenizer's vocabulary and merges."""
        if vtype in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype != _GGUF_ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype not in _GGUF_SCALARS:
            values = [self.value(etype, keep_array) for _ in range(count)]
            return values if keep_array else None
        layout = f"<{count}{_GGUF_SCALARS[etype]}"
        if self.pos + struct.calcsize(layout) > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header")
        values = list(struct.unpack_from(layout, self.buf, self.pos)) if keep_array else None
        self.pos += struct.calcsize(layout)
        return values


def read_gguf(path: str | Path, arrays: Collection[str] = ()) -> GGUFFile:
    """Metadata and raw tensors (memory-mapped, nothing dequantized) of a GGUF v2/v3 file.

    Our own header walk: the gguf package's reader materialises every array (the 49k-entry
    vocabulary and merges) and takes seconds; we skip arrays and keep scalar metadata, plus the
    array values of the keys in ``arrays`` (as lists)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data), path)
    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        value = cur.value(cur.scalar("I"), keep_array=key in arrays)
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]  # innermost (columns) first
        infos.append((name, dims, GGMLQuantizationType(cur.scalar("I")), cur.scalar("Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, qtype, offset in infos:
        shape = tuple(int(d) for d in reversed(dims))  # torch order
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ValueError(f"{path}: tensor {name} row of {dims[0]} is not a whole number of {qtype.name} blocks")
        row_bytes = dims[0] // block * block_bytes
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        begin = start + offset
        if begin + rows * row_bytes > len(data):
            raise ValueError(f"{path}: tensor {name} extends past the end of the file")
        raw = data[begin : begin + rows * row_bytes]
        if qtype.name in _GGUF_FLOAT_DTYPES:
            arr = raw.view(_GGUF_FLOAT_DTYPES[qtype.name]).reshape(shape)
        else:
            arr = raw.reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name, qtype, shape, arr)
    return GGUFFile(path, metadata, tensors)


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head q/k row interleave on [out, ...] rows (floats or raw blocks):
    GGUF row 2*i + j of a head is Hugging Face row j * head_dim/2 + i."""
    out = rows.shape[0]
    if out % (2 * num_heads):
        raise ValueError(f"cannot un-permute {out} rows over {num_heads} heads")
    grouped = rows.reshape(num_heads, out // num_heads // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(rows.shape)


def _plan(cfg: ModelConfig, names: dict[str, str], permute: bool) -> dict[str, tuple[Source, ...]]:
    # names maps our per-layer roles to checkpoint names with "{i}" for the layer index.
    plan: dict[str, tuple[Source, ...]] = {
        "embed.weight": (Source(names["embed"]),),
        "norm.weight": (Source(names["norm"]),),
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (Source(names["lm_head"]),)
    q_heads, k_heads = (cfg.num_heads, cfg.num_kv_heads) if permute else (None, None)
    for i in range(cfg.num_layers):
        n = {role: name.format(i=i) for role, name in names.items()}
        p = f"layers.{i}."
        plan[p + "attn_norm.weight"] = (Source(n["attn_norm"]),)
        plan[p + "mlp_norm.weight"] = (Source(n["mlp_norm"]),)
        plan[p + "attn.qkv.weight"] = (
            Source(n["q"] + ".weight", q_heads), Source(n["k"] + ".weight", k_heads), Source(n["v"] + ".weight"),
        )
        if cfg.qkv_bias:
            plan[p + "attn.qkv.bias"] = (
                Source(n["q"] + ".bias", q_heads), Source(n["k"] + ".bias", k_heads), Source(n["v"] + ".bias"),
            )
        plan[p + "attn.o.weight"] = (Source(n["o"] + ".weight"),)
        if cfg.o_bias:
            plan[p + "attn.o.bias"] = (Source(n["o"] + ".bias"),)
        if cfg.qk_norm:
            plan[p + "attn.q_norm.weight"] = (Source(n["q_norm"]),)
            plan[p + "attn.k_norm.weight"] = (Source(n["k_norm"]),)
        plan[p + "mlp.gate_up.weight"] = (Source(n["gate"]), Source(n["up"]))
        plan[p + "mlp.down.weight"] = (Source(n["down"]),)
    return plan


def hf_sources(cfg: ModelConfig) -> dict[str, tuple[Source, ...]]:
    """Our parameter name -> Hugging Face checkpoint tensors (concatenated along rows)."""
    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    names = {
        "embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight",
        "attn_norm": "model.layers.{i}.input_layernorm.weight",
        "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
        "q": a + "q_proj", "k": a + "k_proj", "v": a + "v_proj", "o": a + "o_proj",
        "q_norm": a + "q_norm.weight", "k_norm": a + "k_norm.weight",
        "gate": m + "gate_proj.weight", "up": m + "up_proj.weight", "down": m + "down_proj.weight",
    }
    return _plan(cfg, names, permute=False)


def gguf_sources(cfg: ModelConfig) -> dict[str, tuple[Source, ...]]:
    """Our parameter name -> GGUF tensors (concatenated along rows), with the q/k un-permutation
    llama.cpp's converter requires for the ``llama`` architecture only."""
    b = "blk.{i}."
    names = {
        "embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight",
        "attn_norm": b + "attn_norm.weight", "mlp_norm": b + "ffn_norm.weight",
        "q": b + "attn_q", "k": b + "attn_k", "v": b + "attn_v", "o": b + "attn_output",
        "q_norm": b + "attn_q_norm.weight", "k_norm": b + "attn_k_norm.weight",
        "gate": b + "ffn_gate.weight", "up": b + "ffn_up.weight", "down": b + "ffn_down.weight",
    }
    return _plan(cfg, names, permute=cfg.arch == "llama")


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    metadata = dict(gguf.metadata)
    arch = metadata.get("general.architecture")
    if f"{arch}.vocab_size" not in metadata and "token_embd.weight" in gguf.tensors:
        metadata[f"{arch}.vocab_size"] = gguf.tensors["token_embd.weight"].shape[0]
    divisors = None
    if "rope_freqs.weight" in gguf.tensors:  # llama3 RoPE scaling, stored as per-frequency divisors
        divisors = tuple(float(x) for x in gguf.tensors["rope_freqs.weight"].dequantize())
    return ModelConfig.from_gguf(metadata, gguf.tensors.keys(), divisors)


def load_config(path: str | Path) -> ModelConfig:
    """The model configuration of a Hugging Face directory or a GGUF file."""
    path = Path(path)
    if is_gguf(path):
        return gguf_config(read_gguf(path))
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: expected a Hugging Face model directory with config.json, or a .gguf file")
    return ModelConfig.from_hf(json.loads(config_file.read_text()))


def _hf_tensors(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors is supported)"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _assemble(plan: dict[str, tuple[Source, ...]], fetch) -> dict[str, torch.Tensor]:
    state = {}
    for param, sources in plan.items():
        parts = [fetch(s) for s in sources]
        state[param] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return state


def gguf_state_dict(gguf: GGUFFile, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """fp32 tensors in our parameter layout, dequantized from a read GGUF file."""

    def fetch(src: Source) -> torch.Tensor:
        if src.name not in gguf.tensors:
            raise ValueError(f"{gguf.path}: GGUF tensor {src.name!r} is missing")
        t = gguf.tensors[src.name]
        if src.unpermute_heads is not None:
            t = GGUFTensor(t.name, t.qtype, t.shape, unpermute_rows(t.data, src.unpermute_heads))
        return t.dequantize()

    return _assemble(gguf_sources(cfg), fetch)


def hf_state_dict(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """fp32 tensors in our parameter layout from a Hugging Face directory's safetensors."""
    from safetensors import safe_open

    path = Path(path)
    files = _hf_tensors(path)
    handles: dict[Path, Any] = {}

    def fetch(src: Source) -> torch.Tensor:
        if src.name not in files:
            raise ValueError(f"{path}: checkpoint tensor {src.name!r} is missing")
        file = files[src.name]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        return handles[file].get_tensor(src.name).float()

    return _assemble(hf_sources(cfg), fetch)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    make_linear: LinearFactory = default_linear,
    before_weights: Callable[[ModelConfig], None] | None = None,
    device: str | torch.device = "cpu",
) -> LlamaModel:
    """A ready (eval, no grad) model from a Hugging Face directory or a GGUF file. GGUF quantized
    weights are dequantized to fp32 first, then cast to ``dtype`` (float32 or bfloat16).
    ``before_weights(config)`` runs once the configuration is known, before any weight is read
    (e.g. to refuse a model that cannot fit). ``device``: the model is made there and each weight
    is copied from the file straight to it (a CUDA model never holds a whole host copy)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    path = Path(path)
    gguf = read_gguf(path) if is_gguf(path) else None  # parsed once: GGUF metadata is slow to read
    cfg = gguf_config(gguf) if gguf is not None else load_config(path)
    if before_weights is not None:
        before_weights(cfg)
    with torch.device(device):  # parameters are allocated on the device; load_weights copies into their device
        model = LlamaModel(cfg, make_linear)
    model.load_weights(_state_dict(path, gguf, cfg))
    log.info("loaded %s (%s, %d layers, hidden %d) from %s", cfg.arch, dtype, cfg.num_layers, cfg.hidden_size, path)
    return model.to(dtype).eval()


def load_state_dict(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The configuration and the fp32 tensors (our parameter layout) of a Hugging Face directory
    or a GGUF file, without making a model."""
    path = Path(path)
    gguf = read_gguf(path) if is_gguf(path) else None
    cfg = gguf_config(gguf) if gguf is not None else load_config(path)
    return cfg, _state_dict(path, gguf, cfg)


def _state_dict(path: Path, gguf: GGUFFile | None, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return gguf_state_dict(gguf, cfg) if gguf is not None else hf_state_dict(path, cfg)
