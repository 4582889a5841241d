"""Model configuration for the Llama family, read from a Hugging Face config.json or GGUF metadata
(and to and from the JSON an engine's manifest keeps).

One frozen ``ModelConfig`` describes every supported architecture; the differences between them
are a handful of switches (q/k/v bias, per-head q/k RMSNorm, tied embeddings, RoPE scaling).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Collection, Mapping

import torch

# Hugging Face ``model_type`` (= GGUF ``general.architecture``) values we implement.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# RoPE variants we implement ("default" = plain RoPE).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _unsupported_arch(arch: object) -> ValueError:
    return ValueError(
        f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
        "(Llama 2/3, SmolLM/SmolLM2, Qwen2/2.5, Qwen3)"
    )


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (half-split rotation, as in Hugging Face Llama)."""

    theta: float  # base wavelength
    kind: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # "linear"/"llama3": position interpolation factor
    low_freq_factor: float = 1.0  # "llama3" only
    high_freq_factor: float = 4.0  # "llama3" only
    original_max_position: int = 8192  # "llama3" only: pre-training context length
    # GGUF stores llama3 scaling as per-frequency divisors (tensor rope_freqs.weight) instead.
    freq_divisors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {self.kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be > 0, got theta={self.theta}, factor={self.factor}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[head_dim // 2] fp32 inverse frequencies, computed the way transformers computes them."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            inv = self._llama3(inv)
        if self.freq_divisors is not None:
            if len(self.freq_divisors) != head_dim // 2:
                raise ValueError(f"rope freq_divisors has {len(self.freq_divisors)} entries, expected {head_dim // 2}")
            inv = inv / torch.tensor(self.freq_divisors, dtype=torch.float32)
        return inv

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and switches of one Llama-family decoder."""

    arch: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # MLP width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when < num_heads)
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool  # lm_head reuses the token embedding (SmolLM2, small Qwen)
    qkv_bias: bool = False  # Qwen2 and Llama attention_bias
    o_bias: bool = False  # Llama attention_bias also biases the output projection
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int = 4096  # informational: the trained context length
    eos_token_ids: tuple[int, ...] = ()  # informational: stop tokens from the checkpoint

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise _unsupported_arch(self.arch)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def qkv_size(self) -> int:
        """Output width of the fused q/k/v projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise _unsupported_arch(arch)
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{arch}: use_sliding_window=True is not supported (full attention only)")
        if cfg.get("mlp_bias"):
            raise ValueError(f"{arch}: mlp_bias=True is not supported")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{arch}: partial_rotary_factor != 1 is not supported")
        missing = [k for k in _HF_REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"{arch} config lacks required keys {missing}")
        heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope=_rope_from_hf(cfg),
            # transformers' default is True when the key is absent.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qkv_bias=True if arch == "qwen2" else attention_bias,
            o_bias=False if arch == "qwen2" else attention_bias,
            qk_norm=arch == "qwen3",
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf(
        cls,
        metadata: Mapping[str, Any],
        tensor_names: Collection[str],
        rope_freq_divisors: tuple[float, ...] | None = None,
    ) -> "ModelConfig":
        """From GGUF key/value metadata and the file's tensor names (which reveal bias, q/k norm,
        and whether an output matrix exists, i.e. whether embeddings are tied)."""
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise _unsupported_arch(arch)

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return value

        heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ValueError(f"GGUF rope scaling {scaling!r} is not supported; supported: none, linear")
        rope = RopeConfig(
            theta=float(key("rope.freq_base", 10000.0)),
            kind="linear" if scaling == "linear" else "default",
            factor=float(metadata.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
            freq_divisors=rope_freq_divisors,
        )
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            arch=arch,
            vocab_size=int(key("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope=rope,
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            max_position_embeddings=int(key("context_length", 4096)),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    def to_json(self) -> dict:
        """A JSON-ready dict (an engine's manifest stores its models' configs this way)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ModelConfig":
        """The inverse of ``to_json`` (JSON turned the tuples into lists)."""
        data = dict(data)
        rope = dict(data.pop("rope"))
        if rope.get("freq_divisors") is not None:
            rope["freq_divisors"] = tuple(rope["freq_divisors"])
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(rope=RopeConfig(**rope), **data)


_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "rms_norm_eps")


def _rope_from_hf(cfg: Mapping[str, Any]) -> RopeConfig:
    # transformers 5 writes "rope_parameters" (theta inside); 4.x wrote rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "linear":
        return RopeConfig(theta=float(theta), kind="linear", factor=float(params["factor"]))
    return RopeConfig(
        theta=float(theta),
        kind="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )
