"""Our torch GGUF dequantizers give gguf's numpy results bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from trtssd.models.dequant import dequantize

Q = GGMLQuantizationType
# Byte offsets of each type's fp16 fields (d, and dmin / m where the type has one).
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def _random_blocks(qtype, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes for every field, with finite fp16 scales (random bits could be NaN)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(rows * blocks_per_row) * 0.01).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * block_bytes)


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_matches_gguf_bit_for_bit(qtype):
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = _random_blocks(qtype, rows=6, blocks_per_row=3)
    shape = (6, 3 * block)
    ours = dequantize(raw, qtype, shape)
    theirs = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)).reshape(shape)
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, theirs)


def test_float_types_and_others_go_through_gguf():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = dequantize(values, Q.F32, (3, 4))
    assert torch.equal(out, torch.from_numpy(values))
    out[0, 0] = 7  # a copy, not a view of (possibly read-only) file memory
    assert values[0, 0] == 0
    half = values.astype(np.float16)
    assert torch.equal(dequantize(half, Q.F16, (3, 4)), torch.from_numpy(values))
