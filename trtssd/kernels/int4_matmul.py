"""The draft's few-row int4 matmul (``int4_matmul.cpp``): y = x @ W.T for W in GGUF Q4_1 groups
(w = scale * code + min, 32 inputs a group), fp32 in and out.

What it computes: each row of x is quantized per group of 32 inputs to 16-bit codes (a finer grid
than bf16's), a group's dot product with the 4-bit codes is exact in integers, and the group's
scale and min are applied in fp32. So the result is the dequantized weight's matmul up to ~1e-4
relative (``tests/test_int4_matmul.py``), where aten's int4 kernel (bf16 activations) was ~5e-3.
At one row on this project's AVX2 machine it was 2.3-2.7x faster than aten's with a projection's
weights cached and 1.3-1.5x with the draft's weights streamed from memory; whole SSD and sd runs
did not change measurably there, memory being the limit (``docs/bench/int4-matmul/``,
``docs/draft.md``).

Weights are laid out once at load time by ``Int4KernelWeight.from_codes``: codes in Q4_1's byte
order, scales and mins as fp16 bits (Q4_1's own precision, checked to be exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtssd.kernels.cpu_extension import load_extension

GROUP_SIZE = 32


@dataclass(frozen=True)
class Int4KernelWeight:
    """A [N, K] weight in the kernel's layout.

    nibbles: [N, K // 2] uint8; group g's 16 bytes hold element i (low nibble) and i + 16 (high).
    scales, mins: [N, K // 32] int16, the bits of fp16 values (not a float dtype, so that
    ``model.to(dtype)`` leaves them alone).
    """

    nibbles: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> "Int4KernelWeight":
        """codes [N, K] uint8 in 0..15, scales / mins [N, K // 32] fp32 holding fp16 values."""
        n, k = codes.shape
        if k % GROUP_SIZE:
            raise ValueError(f"in_features must be a multiple of {GROUP_SIZE}, got {k}")
        grouped = codes.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        half = GROUP_SIZE // 2
        nibbles = (grouped[..., :half] | (grouped[..., half:] << 4)).reshape(n, k // 2).contiguous()
        return cls(nibbles, _fp16_bits(scales, "scales"), _fp16_bits(mins, "mins"))


def _fp16_bits(values: torch.Tensor, name: str) -> torch.Tensor:
    half = values.to(torch.float16)
    if not torch.equal(half.float(), values.float()):
        raise ValueError(f"{name} must hold fp16 values (Q4_1's precision); rounding them would change the weight")
    return half.view(torch.int16).contiguous()


def int4_linear(x: torch.Tensor, weight: Int4KernelWeight) -> torch.Tensor:
    """x [T, K] (any float dtype) -> [T, N] fp32."""
    return load_extension().int4_linear(x.float().contiguous(), weight.nibbles, weight.scales, weight.mins)
