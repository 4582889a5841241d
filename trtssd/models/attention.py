"""Tree attention: the reference semantics every backend and kernel must match.

New tokens (queries) attend to a sequence's committed prefix in full and to its *region*
(slots after the prefix: verification, glue and tree-scratch tokens) through a per-query boolean
mask. Chains, trees and fan-out forests are all just different region masks. RoPE is applied to
q and k before this function, at logical positions that need not equal storage slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtssd import kernels


def visibility_mask(prefix_len: torch.Tensor, region_mask: torch.Tensor, total_len: int) -> torch.Tensor:
    """Expand per-query region masks to a full key mask.

    prefix_len:  [B] int64 committed length per sequence.
    region_mask: [B, n, R] bool; query i sees slot prefix_len[b] + r iff region_mask[b, i, r].
    Returns [B, n, total_len] bool over storage slots.
    """
    B, n, R = region_mask.shape
    slots = torch.arange(total_len, device=region_mask.device)
    rel = slots.view(1, 1, -1) - prefix_len.view(B, 1, 1)  # [B, 1, S] slot index inside the region
    in_prefix = rel < 0
    in_region = (rel >= 0) & (rel < R)
    gathered = torch.gather(region_mask, 2, rel.clamp(0, R - 1).expand(B, n, total_len))
    return in_prefix | (in_region & gathered)


def tree_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: torch.Tensor,
    region_mask: torch.Tensor,
    scale: float | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference attention with grouped-query heads.

    q: [B, H, n, D]; k, v: [B, Hkv, S, D] (storage slots 0..S-1, H % Hkv == 0);
    prefix_len: [B] int64; region_mask: [B, n, R] bool with prefix_len + R <= S. Every query
    row must see at least one key. Returns [B, H, n, D] in q's dtype, accumulated in fp32 when
    inputs are half precision. visible: optionally ``visibility_mask(prefix_len, region_mask, S)``
    computed by the caller, so a model builds it once per forward rather than once per layer.
    """
    mask = visible if visible is not None else visibility_mask(prefix_len, region_mask, k.shape[2])
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.to(dtype)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: torch.Tensor,
    region_mask: torch.Tensor,
    scale: float | None = None,
    kv_rows: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch: the fused Triton kernel on CUDA tensors (trtssd/kernels), the reference (torch
    SDPA with a boolean mask) on CPU or when triton is not installed.

    kv_rows: optional [B] int; then k, v are a KV pool [rows, Hkv, S, D] and sequence b uses row
    kv_rows[b] (the kernel reads it in place; the reference gathers it).
    visible: optional precomputed visibility mask for the reference path (see there); the
    kernel works from prefix_len and region_mask and ignores it."""
    if q.is_cuda:
        kernel = kernels.load_tree_attention_kernel()
        if kernel is not None:
            return kernel(q, k, v, prefix_len, region_mask, scale, kv_rows=kv_rows)
    if kv_rows is not None:
        k, v = k.index_select(0, kv_rows), v.index_select(0, kv_rows)
    return tree_attention_reference(q, k, v, prefix_len, region_mask, scale, visible)
