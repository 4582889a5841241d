"""Bit-packing of region masks into TensorRT-LLM-style int32 words."""

import pytest
import torch

from trtssd.kernels.packed_mask import pack_mask, packed_width, unpack_mask


def naive_pack(mask: torch.Tensor) -> list[list[int]]:
    """Independent reference: one Python int per word, LSB first, then two's complement."""
    rows = mask.reshape(-1, mask.shape[-1]).tolist()
    width = (mask.shape[-1] + 31) // 32
    out = []
    for row in rows:
        words = []
        for w in range(width):
            value = sum(1 << (r - 32 * w) for r in range(32 * w, min(32 * w + 32, len(row))) if row[r])
            words.append(value - (1 << 32) if value >= 1 << 31 else value)
        out.append(words)
    return out


@pytest.mark.parametrize("num_bits", [1, 5, 31, 32, 33, 64, 65, 100])
def test_pack_matches_naive_and_round_trips(num_bits):
    gen = torch.Generator().manual_seed(num_bits)
    mask = torch.rand(2, 3, num_bits, generator=gen) < 0.5
    words = pack_mask(mask)
    assert words.dtype == torch.int32
    assert words.shape == (2, 3, packed_width(num_bits))
    assert words.reshape(-1, words.shape[-1]).tolist() == naive_pack(mask)
    assert torch.equal(unpack_mask(words, num_bits), mask)


def test_bit_layout_is_lsb_first_with_sign_bit_31():
    mask = torch.zeros(4, 64, dtype=torch.bool)
    mask[0, 0] = True  # word 0, bit 0
    mask[1, 31] = True  # word 0, bit 31: negative as a signed int32
    mask[2, 32] = True  # word 1, bit 0
    mask[3, 63] = True
    assert pack_mask(mask).tolist() == [[1, 0], [-(2**31), 0], [0, 1], [0, -(2**31)]]


def test_causal_chain_rows():
    # Token i of a chain sees region slots 0..i: words 1, 3, 7, 15 like TRT-LLM's linear mask.
    chain = torch.ones(4, 4, dtype=torch.bool).tril()
    assert pack_mask(chain).flatten().tolist() == [1, 3, 7, 15]


def test_all_ones_and_all_zeros():
    assert pack_mask(torch.ones(1, 32, dtype=torch.bool)).item() == -1
    assert pack_mask(torch.zeros(2, 40, dtype=torch.bool)).abs().sum().item() == 0


def test_unpack_drops_bits_past_num_bits():
    words = torch.tensor([[-1]], dtype=torch.int32)
    assert unpack_mask(words, 3).tolist() == [[True, True, True]]
    assert unpack_mask(words, 0).shape == (1, 0)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="torch.bool"):
        pack_mask(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="torch.int32"):
        unpack_mask(torch.ones(2, 1, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="num_bits"):
        unpack_mask(torch.ones(2, 1, dtype=torch.int32), 33)
    with pytest.raises(ValueError, match="num_bits"):
        packed_width(-1)
