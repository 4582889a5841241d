"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3) over a paged-by-sequence KV pool.

The forward pass takes a *packed* batch: the new tokens of every sequence concatenated, each with
a logical position (for RoPE) and a storage slot (where its K/V goes). Attention reads each
sequence's committed prefix plus the region slots its mask allows (see trtssd/backends/base.py);
the layout of one pass is an ``AttentionBatch``, built once and shared by every layer.

Linear layers are created by a pluggable factory and can be swapped after construction
(``linears()`` / ``set_linear()``), so a quantized draft can reuse this code unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from trtssd.models.attention import tree_attention, visibility_mask
from trtssd.models.config import ModelConfig

log = logging.getLogger(__name__)


class Linear(nn.Module):
    """y = x W^T + b with W [out, in].

    ``pack()`` adds a oneDNN layout of W for CPU. oneDNN reads the weight once for any number of
    rows, so multi-row inputs (K+1 verification, tree steps, prefill) run ~1.6-2x faster than
    MKL's small-M GEMM, and bf16 gets a fast kernel at all. For single-row fp32 inputs MKL's GEMV
    is as fast and matches transformers bit for bit, so fp32 keeps the plain weight for those
    (at the cost of holding W twice) unless asked not to; bf16 drops it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._packed: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def pack(self, keep_plain: bool = True) -> bool:
        """Add the oneDNN layout when it applies (CPU, fp32/bf16); returns whether the module is
        packed. A packed bf16 module has no plain weight any more (inference only), nor has an
        fp32 one when ``keep_plain`` is False (half the memory; single rows then go through
        oneDNN too, which is not bit for bit MKL's GEMV)."""
        w = self.weight
        if self.packed or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return self.packed
        if not torch.backends.mkldnn.is_available():
            return False
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        except RuntimeError as err:  # bf16 on a CPU without AVX-512 (oneDNN has no kernel there)
            log.debug("linear %dx%d stays unpacked: %s", self.out_features, self.in_features, err)
            return False
        if w.dtype == torch.bfloat16 or not keep_plain:
            self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and (self.weight is None or x.shape[0] > 1):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, packed={self.packed}"


# (name, in_features, out_features, bias) -> module mapping [T, in] to [T, out].
LinearFactory = Callable[[str, int, int, bool], nn.Module]


def default_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    return Linear(in_features, out_features, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [T, 1, D] at logical positions for ``apply_rope`` (fp32 angles, then
    cast, as transformers does). The sin table is (-sin, sin) over the two halves."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of x [T, heads, D]. Rolling by D/2 swaps the halves, so this is
    transformers' ``x * cos + rotate_half(x) * sin`` with the same roundings (bitwise equal),
    in four ops instead of nine."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass(frozen=True)
class AttentionBatch:
    """Layout of one forward pass: where each packed token's K/V is stored and what it sees.

    Tokens are packed in sequence order. Sequence b has ``n_b`` new tokens; queries are padded to
    [B, n, ...] for attention only (never through the linears), and each sequence reads keys
    [0, key_len) of its pool row: its committed prefix plus its region (masked).
    """

    positions: torch.Tensor  # [T] logical positions (RoPE)
    cache_rows: torch.Tensor  # [T] KV pool row of each token's sequence
    slots: torch.Tensor  # [T] storage slot each token writes
    seq_rows: tuple[int, ...]  # [B] KV pool row per sequence
    seq_rows_index: torch.Tensor  # the same as a tensor, for gathering K/V when B > 1
    prefix_len: torch.Tensor  # [B] committed length per sequence
    region_mask: torch.Tensor  # [B, n, R] bool (padded query rows see region slot 0 only)
    key_len: int  # keys read per sequence: max over b of prefix_len + R_b
    pad_index: torch.Tensor | None  # [B*n] packed token feeding each padded query row; None when B == 1
    unpad_index: torch.Tensor | None  # [T] padded row of each packed token; None when B == 1
    # [B, n, key_len] key visibility, built once per forward for torch's SDPA (CPU). On CPU every
    # extra op per layer is costly: the weight stream evicts the caches between layers.
    visible: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        seq_rows: Sequence[int],
        prefix_lens: Sequence[int],
        masks: Sequence[torch.Tensor],
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> "AttentionBatch":
        """seq_rows/prefix_lens/masks per sequence (mask b is [n_b, R_b]); positions/slots packed."""
        device = positions.device
        lens = [m.shape[0] for m in masks]
        key_len = max(p + m.shape[1] for p, m in zip(prefix_lens, masks))
        cache_rows = torch.repeat_interleave(
            torch.tensor(list(seq_rows), dtype=torch.long), torch.tensor(lens)
        ).to(device)
        prefix = torch.tensor(list(prefix_lens), dtype=torch.long, device=device)
        rows = tuple(seq_rows)
        rows_index = torch.tensor(rows, dtype=torch.long, device=device)
        with_mask = device.type == "cpu"  # on CUDA the fused kernel reads the region masks directly
        if len(masks) == 1:
            region = masks[0][None]
            visible = visibility_mask(prefix, region, key_len) if with_mask else None
            return cls(positions, cache_rows, slots, rows, rows_index, prefix, region, key_len, None, None, visible)
        n, r = max(lens), max(m.shape[1] for m in masks)
        region = torch.zeros(len(masks), n, r, dtype=torch.bool, device=device)
        region[:, :, 0] = True  # padded rows must see some key; their outputs are dropped
        pad_index = torch.zeros(len(masks), n, dtype=torch.long)
        unpad = []
        start = 0
        for b, (m, nb) in enumerate(zip(masks, lens)):
            region[b, :nb, : m.shape[1]] = m  # R_b >= 1, so this also overwrites the padding default
            pad_index[b, :nb] = torch.arange(start, start + nb)
            unpad.append(torch.arange(b * n, b * n + nb))
            start += nb
        return cls(
            positions, cache_rows, slots, rows, rows_index, prefix, region, key_len,
            pad_index.view(-1).to(device), torch.cat(unpad).to(device),
            visibility_mask(prefix, region, key_len) if with_mask else None,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_rows)

    def write(self, cache: torch.Tensor, x: torch.Tensor) -> None:
        """Store x [T, Hkv, D] into cache [rows, Hkv, max_len, D] at each token's row and slot."""
        cache[self.cache_rows, :, self.slots] = x

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """This pass's keys (or values): [B, Hkv, key_len, D]; a view when B == 1."""
        if self.num_seqs == 1:
            row = self.seq_rows[0]
            return cache[row : row + 1, :, : self.key_len]
        return cache[self.seq_rows_index, :, : self.key_len]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, H, D] (RoPE applied) against the pool; returns [T, H * D]."""
        T, H, D = q.shape
        B = self.num_seqs
        if self.pad_index is None:
            qb = q[None].transpose(1, 2)
        else:
            qb = q.index_select(0, self.pad_index).view(B, -1, H, D).transpose(1, 2)
        if qb.is_cuda:  # the kernel reads the pool rows in place
            out = tree_attention(qb, k_cache, v_cache, self.prefix_len, self.region_mask, scale,
                                 kv_rows=self.seq_rows_index)
        else:
            out = tree_attention(qb, self.read(k_cache), self.read(v_cache), self.prefix_len, self.region_mask,
                                 scale, visible=self.visible)
        out = out.transpose(1, 2).reshape(-1, H * D)
        return out if self.unpad_index is None else out.index_select(0, self.unpad_index)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv = make_linear(f"{prefix}.qkv", cfg.hidden_size, cfg.qkv_size, cfg.qkv_bias)
        self.o = make_linear(f"{prefix}.o", cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, batch: AttentionBatch, cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
        v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])), dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k rotated together: one set of ops per layer
        batch.write(k_cache, qk[:, H:])
        batch.write(v_cache, v)
        return self.o(batch.attend(qk[:, :H], k_cache, v_cache, self.scale))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory):
        super().__init__()
        self.gate_up = make_linear(f"{prefix}.gate_up", cfg.hidden_size, 2 * cfg.intermediate_size, False)
        self.down = make_linear(f"{prefix}.down", cfg.intermediate_size, cfg.hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, make_linear: LinearFactory):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, f"layers.{index}.attn", make_linear)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, f"layers.{index}.mlp", make_linear)

    def forward(self, x, batch, cos, sin, k_cache, v_cache) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), batch, cos, sin, k_cache, v_cache)
        return x + self.mlp(self.mlp_norm(x))


def linear_names(cfg: ModelConfig) -> list[str]:
    """The model's projections: layers.{i}.attn.qkv / .attn.o / .mlp.gate_up / .mlp.down, and
    lm_head."""
    per_layer = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
    return [f"layers.{i}.{p}" for i in range(cfg.num_layers) for p in per_layer] + ["lm_head"]


class LlamaModel(nn.Module):
    """Token ids -> hidden states over the KV pool; ``logits`` projects chosen rows to the vocab.

    Parameter names (the layout every loader produces): ``embed.weight``,
    ``layers.{i}.attn_norm.weight``, ``layers.{i}.attn.qkv.{weight,bias}`` (rows: q, k, v),
    ``layers.{i}.attn.o.{weight,bias}``, ``layers.{i}.attn.{q,k}_norm.weight``,
    ``layers.{i}.mlp_norm.weight``, ``layers.{i}.mlp.gate_up.weight`` (rows: gate, up),
    ``layers.{i}.mlp.down.weight``, ``norm.weight``, ``lm_head.weight`` (absent when tied).
    """

    def __init__(self, cfg: ModelConfig, make_linear: LinearFactory = default_linear):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, make_linear) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = make_linear("lm_head", cfg.hidden_size, cfg.vocab_size, False)
        # Kept out of the parameters/buffers so .to(bfloat16) leaves it fp32.
        self.inv_freq = cfg.rope.inv_freq(cfg.head_dim)
        # Optional compiled stand-in for ``layers`` on few-row forwards (the int4 draft on CPU:
        # trtssd.kernels.draft_layers.FusedDraftLayers); holds references to the same weights.
        self.fused_layers = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take tensors (no copy where dtype/device already match) named as in the class docstring;
        every parameter must be given exactly once."""
        tied = self.config.tie_word_embeddings
        expected = {n for n, _ in self.named_parameters(remove_duplicate=False) if not (tied and n == "lm_head.weight")}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
        for name in expected:
            module_name, _, attr = name.rpartition(".")
            param = getattr(self.get_submodule(module_name), attr)
            if tuple(state[name].shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(state[name].shape)} != expected {tuple(param.shape)}")
            param.data = state[name].to(device=param.device, dtype=param.dtype)
        if tied:
            self.lm_head.weight = self.embed.weight

    def linears(self) -> Iterator[tuple[str, nn.Module]]:
        """Every swappable projection, by name (``linear_names``)."""
        for name in linear_names(self.config):
            yield name, self.get_submodule(name)

    def set_linear(self, name: str, module: nn.Module) -> None:
        """Replace one projection (a name from ``linears()``) with any module of the same in/out."""
        names = {n for n, _ in self.linears()}
        if name not in names:
            raise ValueError(f"unknown linear {name!r}; expected one of the names from linears()")
        parent, _, attr = name.rpartition(".")
        setattr(self.get_submodule(parent) if parent else self, attr, module)

    def pack_linears(self, keep_plain: bool = True) -> int:
        """Re-lay every packable ``Linear`` for oneDNN (CPU); returns how many were packed.
        ``keep_plain``: see ``Linear.pack``."""
        return sum(m.pack(keep_plain) for _, m in self.linears() if isinstance(m, Linear))

    def forward(
        self, tokens: torch.Tensor, batch: AttentionBatch, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """tokens [T] -> hidden states [T, hidden]; writes every token's K/V into ``kv`` (one
        (k, v) pool pair per layer, each [rows, Hkv, max_len, D])."""
        x = self.embed(tokens)
        cos, sin = rope_tables(self.inv_freq, batch.positions, x.dtype)
        if self.fused_layers is not None and self.fused_layers.accepts(tokens.numel(), batch):
            return self.fused_layers(x, batch, cos, sin, kv)
        for layer, (k_cache, v_cache) in zip(self.layers, kv):
            x = layer(x, batch, cos, sin, k_cache, v_cache)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + vocabulary projection of hidden rows [N, hidden] -> [N, V] (model dtype)."""
        return self.lm_head(self.norm(hidden))
