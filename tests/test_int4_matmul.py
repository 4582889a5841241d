"""Our few-row int4 matmul (trtssd/kernels/int4_matmul.cpp) against the dequantized weight's
matmul in float64, and Int4Linear on it."""

import pytest
import torch

from trtssd.kernels.int4_matmul import Int4KernelWeight, int4_linear
from trtssd.models.quant import Int4Linear, groups_from_float, use_int4_kernel


def _weight(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    groups = groups_from_float(torch.randn(n, k, generator=gen) * 0.1)
    return groups, Int4KernelWeight.from_codes(groups.codes, groups.scales, groups.mins)


# Output counts around the kernel's tiles of 2 and 4 outputs, row counts around its blocks of 4.
@pytest.mark.parametrize("n,k", [(1, 32), (37, 64), (96, 576), (130, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16])
def test_matches_the_dequantized_matmul(n, k, rows):
    groups, weight = _weight(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * torch.logspace(-2, 1, k)
    exact = x.double() @ groups.dequantize().double().T
    y = int4_linear(x, weight)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    # 16-bit activation codes per 32 inputs: each input is off by at most half a step,
    # max|x over its group| / 65534, so each output by that times |W| summed (bf16 inputs: ~2e-3).
    group_max = x.abs().reshape(rows, k // 32, 32).amax(-1).repeat_interleave(32, dim=1)
    bound = group_max.double() @ groups.dequantize().abs().double().T / 65534
    err = (y.double() - exact).abs()
    assert (err <= 1.01 * bound + 1e-6 * exact.abs().max()).all(), (err / bound).max().item()


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Each (row, output) is summed in one fixed order whatever the tile, so a draft's logits do
    not depend on how many rows share its forward (up to the fused layers' width)."""
    _, weight = _weight(75, 576, seed=3)
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(4))
    together = int4_linear(x, weight)
    for t in range(13):
        assert torch.equal(together[t], int4_linear(x[t : t + 1], weight)[0])


def test_zero_and_constant_inputs():
    groups, weight = _weight(8, 64)
    assert torch.equal(int4_linear(torch.zeros(2, 64), weight), torch.zeros(2, 8))
    ones = torch.ones(1, 64)  # every code lands exactly on the grid: the result is the row sums
    assert torch.allclose(int4_linear(ones, weight)[0], groups.dequantize().sum(1), rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_refused_with_the_field_named():
    groups, weight = _weight(8, 64)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        int4_linear(torch.zeros(64), weight)
    with pytest.raises(RuntimeError, match="nibbles must be"):
        int4_linear(torch.zeros(1, 96), weight)
    with pytest.raises(ValueError, match="scales must hold fp16 values"):
        Int4KernelWeight.from_codes(groups.codes, groups.scales + 1e-6, groups.mins)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4KernelWeight.from_codes(torch.zeros(2, 48, dtype=torch.uint8), torch.zeros(2, 1), torch.zeros(2, 1))


def test_int4_linear_layer_runs_on_it_with_its_bias():
    groups, weight = _weight(40, 96, seed=5)
    bias = torch.randn(40)
    layer = Int4Linear(groups, bias)
    use_int4_kernel(layer)
    x = torch.randn(3, 5, 96)
    expected = int4_linear(x.reshape(-1, 96), weight).reshape(3, 5, 40) + bias
    assert torch.equal(layer(x), expected)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
