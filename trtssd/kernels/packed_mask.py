"""Bit-packed region masks, in TensorRT-LLM's spec-decoding layout.

TensorRT-LLM's attention plugin takes its tree mask as ``int32 [tokens, ceil(width / 32)]``:
bit ``j`` of a row (word ``j // 32``, bit ``j % 32``, least significant bit first) set means
the token may attend draft token ``j``. We use the same layout for the region mask of
``tree_attention`` (bit ``r`` = may attend region slot ``prefix_len + r``), so the kernel,
the TensorRT plugin and a TensorRT-LLM engine can share one mask format. Packing shrinks the
mask 8x against a bool tensor (32x against TensorRT-LLM's int32-per-bit alternatives).

Both functions work on any leading shape and on any device; they never sync with the host.
"""

from __future__ import annotations

import torch

BITS_PER_WORD = 32


def packed_width(num_bits: int) -> int:
    """Number of int32 words needed for ``num_bits`` mask bits."""
    if num_bits < 0:
        raise ValueError(f"num_bits must be >= 0, got {num_bits}")
    return -(-num_bits // BITS_PER_WORD)


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.ones(BITS_PER_WORD, dtype=torch.int64, device=device) << torch.arange(
        BITS_PER_WORD, dtype=torch.int64, device=device
    )


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask ``[..., R]`` into int32 words ``[..., ceil(R / 32)]``.

    Bit ``r % 32`` of word ``r // 32`` holds ``mask[..., r]``; unused high bits of the last
    word are zero. Words whose bit 31 is set come out negative (two's complement), exactly
    as TensorRT-LLM stores them.
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be torch.bool, got {mask.dtype}")
    if mask.dim() < 1:
        raise ValueError("mask must have at least one dimension (the bit axis)")
    num_bits = mask.shape[-1]
    width = packed_width(num_bits)
    pad = width * BITS_PER_WORD - num_bits
    bits = torch.nn.functional.pad(mask.to(torch.int64), (0, pad))
    bits = bits.reshape(*mask.shape[:-1], width, BITS_PER_WORD)
    words = (bits * _bit_weights(mask.device)).sum(-1)  # in [0, 2**32)
    # Reinterpret as signed 32-bit; an out-of-range int64 -> int32 cast is not portable.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).contiguous()


def unpack_mask(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: int32 ``[..., W]`` to bool ``[..., num_bits]``.

    ``num_bits`` must fit in the words (``num_bits <= 32 * W``); bits past it are dropped.
    """
    if words.dtype != torch.int32:
        raise ValueError(f"words must be torch.int32, got {words.dtype}")
    if words.dim() < 1:
        raise ValueError("words must have at least one dimension (the word axis)")
    capacity = words.shape[-1] * BITS_PER_WORD
    if not 0 <= num_bits <= capacity:
        raise ValueError(f"num_bits must be in [0, {capacity}] for {words.shape[-1]} words, got {num_bits}")
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    bits = (unsigned.unsqueeze(-1) & _bit_weights(words.device)) != 0
    return bits.reshape(*words.shape[:-1], capacity)[..., :num_bits]
