"""GGUF block dequantization in torch, for the quantization types our models ship in.

Why not ``gguf.quants.dequantize``: it is numpy over groups of 16 rows, ~100-200 M weights/s on
one core here, so reading the 1.5B Qwen2.5-Coder target took ~25 s of its ~35 s start-up. The
same arithmetic as whole-tensor torch ops (in place, so the ~6 GB of fp32 weights of a 1.5B model
are allocated once) is ~3x faster. Every type below does exactly gguf's fp32 operations in gguf's
order (no fused multiply-add; x * d for d * x is the same IEEE product), so the result is bit for
bit gguf's (tests/test_dequant.py); any other type falls back to gguf's own dequantizer.

Block layouts (ggml's): ``d``/``dmin``/``m`` are fp16; ``QK_K`` = 256-weight super-blocks.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

QK_K = 256
_Q = GGMLQuantizationType
_BITS = torch.arange(8, dtype=torch.uint8)  # shifts that spread a byte into its 8 bits


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, as fp32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes [n, g * width] -> [n, g * 2 * width]: per group of ``width`` bytes, the low nibbles
    first, then the high ones (ggml's element order)."""
    n = qs.shape[0]
    grouped = qs.reshape(n, -1, 1, width)
    return torch.cat([grouped & 0x0F, grouped >> 4], dim=2).reshape(n, -1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return (_nibbles(b[:, 2:], 16).to(torch.int8) - 8).float().mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:], 16).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # 4 bytes of fifth bits (bit i of the little-endian word = element i), 16 bytes of nibbles.
    fifth = ((b[:, 2:6].unsqueeze(-1) >> _BITS) & 1).reshape(-1, 32)
    q = _nibbles(b[:, 6:], 16) | (fifth << 4)
    return (q.view(torch.int8) - 16).float().mul_(_f16(b, 0))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(b, 0))


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of 6-bit scales and mins -> ([n, 8], [n, 8]) uint8."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    scale = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    low = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
    return q.mul_(scale).sub_(low).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d.
    n = b.shape[0]
    scale = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(b[:, :128], 64).reshape(n, -1, 32)
    high = b[:, 128:192].reshape(n, -1, 1, 32)
    high = torch.cat([(high >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(n, -1, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return q.mul_(scale).reshape(n, QK_K)


_DEQUANTIZERS = {
    _Q.Q4_0: (32, 18, _q4_0),
    _Q.Q4_1: (32, 20, _q4_1),
    _Q.Q5_0: (32, 22, _q5_0),
    _Q.Q8_0: (32, 34, _q8_0),
    _Q.Q4_K: (QK_K, 144, _q4_k),
    _Q.Q6_K: (QK_K, 210, _q6_k),
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 tensor of ``shape`` from GGUF data as stored (raw block bytes, or typed floats)."""
    if qtype in _DEQUANTIZERS:
        block, block_bytes, decode = _DEQUANTIZERS[qtype]
        # A copy: the GGUF is a read-only map, which torch cannot wrap; the raw bytes are small.
        raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, block_bytes))
        return decode(raw).reshape(shape)
    values = gguf_dequantize(data, qtype)
    if np.may_share_memory(values, data):  # F32 comes back as a view of the read-only map
        values = values.copy()
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
