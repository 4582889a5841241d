"""4-bit weight-only linear layers for the quantized self-draft.

The draft runs the target's own GGUF weights as 4-bit codes in groups of 32 along the input
dimension, with GGUF Q4_1's rule ``w = d * q + m`` (q in 0..15, d and m fp16 per group), through
one of two CPU kernels. Nothing is re-quantized for Q4_1 tensors; weights that are not Q4_1
(SmolLM2's tied Q8_0 embedding, fp32 test models) are quantized here with the same asymmetric
min/max rule that produces Q4_1.

- Ours (``trtssd.kernels.int4_matmul``, once the compiled extension is loaded): fp32 in and
  out, activations on a 16-bit grid per group, integer dot products; the dequantized weight's
  matmul up to ~1e-4 relative, and faster than aten's at one row (docs/draft.md, "Our int4 matmul").
- aten's (``aten._weight_int4pack_mm_for_cpu``), the fallback where the extension cannot be
  built: its format is ``w = (code - 8) * scale + zero``, so the same codes with scale = d and
  zero = m + 8 d. It is fast only with bf16 activations and takes scales/zeros in the activation
  dtype, so it computes bf16(x) @ W'.T with bf16-rounded scales and zeros and a bf16 output:
  the same class of error as running the layer in bf16.

Many rows (a prefill, a wide tree step): an int4 kernel is a matrix-vector kernel at heart, and
on a CPU without fast bf16 it loses to an fp32 GEMM beyond a handful of rows (on the 2-core AMD
EPYC here, one 576x1536 projection of 150 rows: 8.4 ms aten int4, 3.9 ms fp32; equal at 6 rows). So
layers built with ``dense_above`` also keep the dequantized fp32 weight and use it for forwards
of more rows than that. The draft's distribution then depends slightly on how many rows share a
forward, which exactness does not mind: every proposal is verified against the q it was drawn from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from trtssd.kernels.int4_matmul import Int4KernelWeight, int4_linear
from trtssd.models.config import ModelConfig
from trtssd.models.llama import Linear, LlamaModel
from trtssd.models.loader import GGUFFile, GGUFTensor, gguf_sources, unpermute_rows

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # Q4_1 block size; also the kernel's group size we use
CODE_OFFSET = 8  # the kernel dequantizes (code - 8) * scale + zero
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
COMPUTE_DTYPE = torch.bfloat16  # the only activation dtype with a fast CPU int4 kernel
_N_MULTIPLE = 16  # the packing op requires out_features % 16 == 0
_INNER_K_TILES = 2  # layout hint of the packing op; the CPU kernel's speed does not depend on it
DENSE_ABOVE_ROWS = 16  # forwards of more rows use the fp32 weight (module docstring; docs/draft.md)


@dataclass(frozen=True)
class Int4Groups:
    """A [N, K] weight as 4-bit codes with one scale and min per 32 inputs: w = scale * code + min.

    codes:  [N, K] uint8 in 0..15.
    scales: [N, K // 32] fp32.
    mins:   [N, K // 32] fp32.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __post_init__(self) -> None:
        if self.codes.dim() != 2 or self.codes.dtype != torch.uint8:
            raise ValueError(f"codes must be a 2-D uint8 tensor, got {self.codes.dtype} {tuple(self.codes.shape)}")
        n, k = self.codes.shape
        if k % GROUP_SIZE:
            raise ValueError(f"in_features must be a multiple of {GROUP_SIZE}, got {k}")
        for name in ("scales", "mins"):
            t = getattr(self, name)
            if t.shape != (n, k // GROUP_SIZE) or t.dtype != torch.float32:
                raise ValueError(f"{name} must be fp32 [{n}, {k // GROUP_SIZE}], got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 weight (one rounding of scale * code + min, as GGUF's dequantizer does)."""
        scales = self.scales.repeat_interleave(GROUP_SIZE, dim=1)
        mins = self.mins.repeat_interleave(GROUP_SIZE, dim=1)
        return scales * self.codes.float() + mins


def groups_from_q4_1(raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> Int4Groups:
    """Decode GGUF Q4_1 bytes (as stored: [N, K // 32 * 20] uint8) for a weight of ``shape`` (N, K).

    Each 20-byte block is fp16 d, fp16 m, then 16 bytes whose low nibbles are elements 0..15
    of the block and high nibbles elements 16..31.
    """
    n, k = shape
    if k % GROUP_SIZE:
        raise ValueError(f"Q4_1 in_features must be a multiple of {GROUP_SIZE}, got {k}")
    blocks = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8)).reshape(-1)
    n_groups = k // GROUP_SIZE
    if blocks.size != n * n_groups * Q4_1_BLOCK_BYTES:
        raise ValueError(f"Q4_1 data has {blocks.size} bytes, expected {n * n_groups * Q4_1_BLOCK_BYTES} for shape {shape}")
    blocks = blocks.reshape(n, n_groups, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, k)
    return Int4Groups(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))


def groups_from_float(weight: torch.Tensor) -> Int4Groups:
    """Quantize an fp weight [N, K] to 4-bit groups with the Q4_1 rule (min/max per 32 inputs,
    round to nearest). Used for weights the GGUF does not store as Q4_1 (a lossy step)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(f"weight must be [N, K] with K a multiple of {GROUP_SIZE}, got {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo = blocks.amin(dim=-1)
    hi = blocks.amax(dim=-1)
    # Keep scales and mins in fp16 like Q4_1, so a GGUF round trip gives the same groups.
    scales = ((hi - lo) / 15).half().float()
    mins = lo.half().float()
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    codes = ((blocks - mins.unsqueeze(-1)) * inv.unsqueeze(-1)).round().clamp(0, 15)
    return Int4Groups(codes.reshape(n, k).to(torch.uint8), scales, mins)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 codes → [N, K // 2] bytes, element 2i in the low nibble (our storage layout;
    independent of the kernel's private layout, which is rebuilt at load time)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)



def concat_groups(parts: Sequence[Int4Groups]) -> Int4Groups:
    """Stack weights along rows (fused q|k|v and gate|up projections)."""
    if len(parts) == 1:
        return parts[0]
    return Int4Groups(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), torch.cat([p.mins for p in parts])
    )


def _pad_rows(groups: Int4Groups, multiple: int) -> Int4Groups:
    pad = -groups.shape[0] % multiple
    if pad == 0:
        return groups
    n_groups = groups.scales.shape[1]
    return concat_groups([
        groups,
        Int4Groups(
            torch.zeros(pad, groups.shape[1], dtype=torch.uint8),
            torch.zeros(pad, n_groups),
            torch.zeros(pad, n_groups),
        ),
    ])


class Int4Linear(nn.Module):
    """y = x @ W.T (+ bias) with W held as 4-bit groups and run by a CPU int4 kernel.

    Accepts any float input dtype [..., K] and returns it. ``use_kernel`` (set once the compiled
    extension is loaded, ``engine_dir.attach_fused_layers``): our int4 matmul, fp32 throughout
    (trtssd.kernels.int4_matmul); otherwise aten's, in bf16 (see module docstring), with
    out_features padded internally to its multiple of 16 (zero rows, sliced off).
    in_features must be a multiple of 32. ``dense_above``: forwards of more rows than this use
    the dequantized fp32 weight (module docstring).
    """

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None = None, dense_above: int | None = None) -> None:
        super().__init__()
        self.dense_above = dense_above
        self.dense = None if dense_above is None else _dense_linear(groups)
        self.out_features, self.in_features = groups.shape
        self.kernel_weight = Int4KernelWeight.from_codes(groups.codes, groups.scales, groups.mins)
        self.use_kernel = False
        padded = _pad_rows(groups, _N_MULTIPLE)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded.codes.to(torch.int32), _INNER_K_TILES)
        zeros = padded.mins + CODE_OFFSET * padded.scales
        # Kernel layout: [K // 32, N, 2] holding (scale, zero) in the activation dtype.
        scale_zeros = torch.stack([padded.scales.t(), zeros.t()], dim=-1).to(COMPUTE_DTYPE).contiguous()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale_zeros", scale_zeros, persistent=False)
        self._padded = padded.shape[0] != self.out_features
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def _apply(self, fn, recurse: bool = True):
        # model.to(dtype) casts every float buffer; the kernel needs its (scale, zero) pairs in
        # bf16 (they were bf16 to begin with, so a round trip through fp32 is exact).
        super()._apply(fn, recurse)
        self.scale_zeros = self.scale_zeros.to(COMPUTE_DTYPE)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.dense is not None and flat.shape[0] > self.dense_above:
            y = self.dense(flat.float())
        elif self.use_kernel:
            y = int4_linear(flat, self.kernel_weight)
        else:
            # One call per projection per token: the fast path is kept to three aten calls.
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat.to(COMPUTE_DTYPE).contiguous(), self.packed, GROUP_SIZE, self.scale_zeros
            )
            if self._padded:
                y = y[:, : self.out_features]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP_SIZE}"


def use_int4_kernel(model: nn.Module) -> None:
    """Run every Int4Linear of ``model`` (a RescoredInt4Head's too) on our compiled int4 matmul;
    call once the extension is loaded (trtssd.kernels.cpu_extension)."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.use_kernel = True


def _dense_linear(groups: Int4Groups) -> Linear:
    """The dequantized fp32 projection (no bias: the caller adds its own), in oneDNN's layout
    where it applies (then without a plain copy)."""
    out_features, in_features = groups.shape
    dense = Linear(in_features, out_features, bias=False)
    dense.weight.data = groups.dequantize()
    dense.pack(keep_plain=False)
    return dense


class RescoredInt4Head(nn.Module):
    """Vocabulary projection for a draft: int4 logits for every token, then the ``top_k`` best
    re-scored exactly in fp32 against ``weight`` (the unquantized [V, H] matrix; the token
    embedding when tied, which a model's ``load_weights`` assigns to ``self.weight``).

    Why: requantizing SmolLM2's Q8_0 output matrix to 4 bits flips the argmax on ~10% of tokens
    when the top two logits are close; re-scoring a handful of candidates in fp32 removes nearly
    all of those flips for the cost of reading ``top_k`` rows. The returned logits are the
    draft's distribution (exact at the top, int4 in the tail), used alike for sampling and
    verification, so exactness of speculative decoding is unaffected.
    """

    def __init__(self, groups: Int4Groups, weight: torch.Tensor, top_k: int = 16, dense_above: int | None = None) -> None:
        super().__init__()
        self.dense_above = dense_above  # more rows than this: every logit exact from ``weight``
        if not isinstance(top_k, int) or not 0 <= top_k <= groups.shape[0]:
            raise ValueError(f"top_k must be an int in [0, {groups.shape[0]}], got {top_k!r}")
        if tuple(weight.shape) != groups.shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} != quantized shape {groups.shape}")
        self.int4 = Int4Linear(groups)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.top_k = top_k
        self.in_features, self.out_features = groups.shape[1], groups.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.dense_above is not None and flat.shape[0] > self.dense_above:
            logits = nn.functional.linear(flat.to(self.weight.dtype), self.weight).to(flat.dtype)
            return logits.reshape(*lead, self.out_features)
        logits = self.int4(flat)
        if self.top_k:
            top = logits.topk(self.top_k, dim=-1).indices  # [N, k]
            rows = self.weight[top].to(flat.dtype)  # [N, k, H]
            exact = torch.bmm(rows, flat.unsqueeze(-1)).squeeze(-1)
            logits = logits.scatter(-1, top, exact.to(logits.dtype))
        return logits.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, top_k={self.top_k}"


# -- GGUF → 4-bit groups for a LlamaModel ----------------------------------------------------------------


def tensor_groups(tensor: GGUFTensor, unpermute_heads: int | None = None) -> tuple[Int4Groups, bool]:
    """One GGUF matrix as 4-bit groups; returns (groups, exact). Q4_1 blocks are decoded as they
    are (exact); any other type is dequantized and re-quantized with the Q4_1 rule (lossy)."""
    if len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name}: expected a matrix, got shape {tensor.shape}")
    if tensor.qtype == GGMLQuantizationType.Q4_1:
        raw = tensor.data if unpermute_heads is None else unpermute_rows(tensor.data, unpermute_heads)
        return groups_from_q4_1(raw, tensor.shape), True
    if unpermute_heads is not None:
        tensor = GGUFTensor(tensor.name, tensor.qtype, tensor.shape, unpermute_rows(tensor.data, unpermute_heads))
    return groups_from_float(tensor.dequantize()), False


def gguf_linear_groups(gguf: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, Int4Groups, bool]]:
    """(linear name as in ``LlamaModel.linears()``, its 4-bit groups, exact?) for every projection
    of the model in a GGUF file, the output layer last (from the embedding when tied)."""
    plan = gguf_sources(cfg)
    names = [f"layers.{i}.{part}" for i in range(cfg.num_layers) for part in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")]
    names.append("lm_head")
    for name in names:
        param = "embed.weight" if name == "lm_head" and cfg.tie_word_embeddings else f"{name}.weight"
        parts, exact = [], True
        for src in plan[param]:
            if src.name not in gguf.tensors:
                raise ValueError(f"{gguf.path}: GGUF tensor {src.name!r} is missing")
            groups, part_exact = tensor_groups(gguf.tensors[src.name], src.unpermute_heads)
            parts.append(groups)
            exact = exact and part_exact
        yield name, concat_groups(parts), exact


def quantize_linears(model: LlamaModel, groups: Mapping[str, Int4Groups], head_top_k: int = 16,
                     dense_above: int | None = None) -> LlamaModel:
    """Swap the model's projections for 4-bit ones in place: ``Int4Linear`` for every layer,
    ``RescoredInt4Head`` for ``lm_head``. Biases and the head's exact weight are kept as
    parameters (still to be filled by ``model.load_weights``). Every projection must be given.
    ``dense_above``: see ``Int4Linear`` (None: int4 at every row count)."""
    current = dict(model.linears())
    if set(groups) != set(current):
        missing, unexpected = set(current) - set(groups), set(groups) - set(current)
        raise ValueError(f"4-bit weights do not match the model: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    for name, module in current.items():
        g = groups[name]
        if (module.out_features, module.in_features) != g.shape:
            raise ValueError(f"{name}: model shape {(module.out_features, module.in_features)} != 4-bit shape {g.shape}")
        if name == "lm_head":
            new: nn.Module = RescoredInt4Head(g, torch.empty(g.shape), head_top_k, dense_above)
        else:
            new = Int4Linear(g, getattr(module, "bias", None), dense_above)
        model.set_linear(name, new)
    logger.debug("quantized %d projections to int4", len(current))
    return model
