"""Int4 groups and Int4Linear against GGUF's own Q4_1 (de)quantizer and a float64 reference."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from trtssd.backends.base import Chunk, chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.models.config import ModelConfig, RopeConfig
from trtssd.models.llama import LlamaModel
from trtssd.models.quant import (
    GROUP_SIZE,
    Int4Groups,
    Int4Linear,
    RescoredInt4Head,
    groups_from_float,
    groups_from_q4_1,
    pack_nibbles,
    quantize_linears,
    unpack_nibbles,
)
from tiny_models import tiny_int4_pair

Q4_1 = GGMLQuantizationType.Q4_1
BF16_EPS = 2.0**-8  # bf16 has 8 significant bits: relative rounding error <= 2^-8


def _q4_1_weight(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random Q4_1 bytes made by gguf's quantizer and gguf's own dequantization of them."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    raw = quantize(w, Q4_1)
    return raw, dequantize(raw, Q4_1)


def test_q4_1_decode_matches_gguf_dequantizer():
    raw, ref = _q4_1_weight(48, 96)
    groups = groups_from_q4_1(raw, (48, 96))
    assert torch.equal(groups.dequantize(), torch.from_numpy(ref))
    assert int(groups.codes.max()) <= 15


def test_q4_1_decode_rejects_wrong_size():
    raw, _ = _q4_1_weight(16, 64)
    with pytest.raises(ValueError, match="bytes"):
        groups_from_q4_1(raw, (16, 96))


def test_nibble_round_trip():
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def _kernel_reference(x: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    """What the kernel promises: bf16 inputs and bf16 (scale, zero) with the codes exact, float64 here."""
    scales = groups.scales.bfloat16().double()
    zeros = (groups.mins + 8 * groups.scales).bfloat16().double()
    w = (groups.codes.double() - 8) * scales.repeat_interleave(GROUP_SIZE, 1) + zeros.repeat_interleave(GROUP_SIZE, 1)
    return x.bfloat16().double() @ w.T


@pytest.mark.parametrize("rows", [1, 5])
def test_int4_linear_matches_dequantized_weight(rows):
    raw, ref_w = _q4_1_weight(64, 256, seed=rows)
    groups = groups_from_q4_1(raw, (64, 256))
    layer = Int4Linear(groups)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 64)
    # Tight: the only error left is the output's bf16 rounding and fp32 accumulation.
    ref = _kernel_reference(x, groups)
    assert torch.allclose(y.double(), ref, rtol=BF16_EPS, atol=1e-4 * ref.abs().max().item())
    # Against the exact fp32 dequantized weight: bf16-class error, far below a wrong mapping's.
    exact = x.double() @ torch.from_numpy(ref_w).double().T
    err = (y.double() - exact).abs().max().item()
    assert err < 2e-2 * exact.abs().max().item()


def test_int4_linear_keeps_leading_dims_and_bias():
    raw, ref_w = _q4_1_weight(32, 64)
    bias = torch.randn(32)
    layer = Int4Linear(groups_from_q4_1(raw, (32, 64)), bias)
    x = torch.randn(2, 3, 64)
    y = layer(x)
    exact = x @ torch.from_numpy(ref_w).T + bias
    assert y.shape == (2, 3, 32)
    assert torch.allclose(y, exact, atol=2e-2 * exact.abs().max().item())


def test_int4_linear_pads_rows_to_kernel_multiple():
    w = torch.randn(40, 64)  # 40 rows: the kernel needs a multiple of 16
    groups = groups_from_float(w)
    x = torch.randn(3, 64)
    y = Int4Linear(groups)(x)
    assert y.shape == (3, 40)
    assert torch.allclose(y.double(), _kernel_reference(x, groups), rtol=BF16_EPS, atol=1e-3)


def test_int4_linear_survives_module_dtype_casts():
    groups = groups_from_float(torch.randn(32, 64))
    layer = Int4Linear(groups)
    x = torch.randn(2, 64)
    before = layer(x)
    layer.to(torch.float32)  # what model.to(dtype) does to every float buffer
    assert layer.scale_zeros.dtype == torch.bfloat16
    assert torch.equal(layer(x), before)


def test_int4_linear_uses_the_fp32_weight_above_dense_rows():
    """Many rows (prefill, wide trees) take the dequantized fp32 weight: exact to fp32, bias
    included even when it is loaded after construction (as ``model.load_weights`` does)."""
    raw, ref_w = _q4_1_weight(48, 128, seed=3)
    groups = groups_from_q4_1(raw, (48, 128))
    layer = Int4Linear(groups, torch.zeros(48), dense_above=4)
    layer.bias.data = torch.randn(48)
    plain = Int4Linear(groups, layer.bias.data)
    exact_w = torch.from_numpy(ref_w).double()
    many, few = torch.randn(2, 5, 128), torch.randn(4, 128)
    got = layer(many)
    exact = many.double() @ exact_w.T + layer.bias.double()
    assert got.shape == (2, 5, 48)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain(many).double(), exact, rtol=1e-5, atol=1e-5)  # bf16 rounding there
    assert torch.equal(layer(few), plain(few))  # few rows: the int4 kernel, as without dense_above


def test_rescored_head_is_exact_everywhere_above_dense_rows():
    groups = groups_from_float(torch.randn(64, 32))
    weight = torch.randn(64, 32)
    head = RescoredInt4Head(groups, weight, top_k=2, dense_above=3)
    x = torch.randn(5, 32)
    assert torch.allclose(head(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(head(x[:3]), x[:3] @ weight.T, rtol=1e-5, atol=1e-5)


def test_groups_from_float_error_bound():
    w = torch.randn(32, 128)
    groups = groups_from_float(w)
    blocks = w.reshape(32, -1, GROUP_SIZE)
    half_step = ((blocks.amax(-1) - blocks.amin(-1)) / 15 / 2).repeat_interleave(GROUP_SIZE, 1)
    # Round to nearest: each weight within half a step (plus fp16 rounding of scale and min).
    assert ((groups.dequantize() - w).abs() <= half_step * 1.01 + 1e-3).all()


# -- the int4 executor against the same model with the dequantized weights in fp32 ---------------

TINY = ModelConfig(
    arch="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0), tie_word_embeddings=False,
)  # vocab 100 is not a multiple of 16: exercises the head's row padding


def _tiny_pair(top_k: int) -> tuple[TorchExecutor, TorchExecutor]:
    draft, ref = tiny_int4_pair(TINY, top_k)
    assert isinstance(draft.model.lm_head, RescoredInt4Head)
    return draft, ref


def _run(ex: TorchExecutor, prompt: list[int], glue: list[int], forks: list[int]) -> tuple[torch.Tensor, ...]:
    """Prefill, a glue chain, then one tree step: each fork token sees prompt + glue[:depth+1]."""
    ex.add_sequence(0)
    n = len(prompt)
    pre = ex.forward([chain_chunk(0, prompt, 0)])[0]
    ex.commit(0, n)
    glue_logits = ex.forward([chain_chunk(0, glue, n)])[0]
    depths = [0, 1, len(glue) - 1]
    region = len(glue) + len(forks)
    mask = torch.zeros(len(forks), region, dtype=torch.bool)
    for i, d in enumerate(depths):
        mask[i, : d + 1] = True
        mask[i, len(glue) + i] = True
    slots = torch.arange(n + len(glue), n + region)
    positions = torch.tensor([n + d + 1 for d in depths])
    tree = ex.forward([Chunk(0, torch.tensor(forks), positions, slots, mask)])[0]
    return pre, glue_logits, tree


def test_int4_executor_matches_dequantized_fp32_model():
    draft, ref = _tiny_pair(top_k=0)
    args = (list(range(3, 40, 3)), [5, 7, 9], [11, 12, 13])
    for ours, exact in zip(_run(draft, *args), _run(ref, *args)):
        scale = exact.abs().max().item()
        # bf16 activations inside the projections: errors of a few bf16 ulps of the logit scale.
        assert (ours - exact).abs().max().item() < 0.03 * scale
        assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.85


def test_rescored_head_is_exact_on_its_top_candidates():
    draft, ref = _tiny_pair(top_k=5)
    hidden = torch.randn(4, TINY.hidden_size)
    head = draft.model.lm_head
    logits = head(hidden)
    exact = hidden @ head.weight.T
    top = head.int4(hidden).topk(5, dim=-1).indices
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(logits, dtype=torch.bool).scatter(1, top, False)
    assert torch.equal(logits[rest], head.int4(hidden)[rest])


def test_quantize_linears_requires_every_projection():
    model = LlamaModel(TINY)
    with pytest.raises(ValueError, match="missing"):
        quantize_linears(model, {"lm_head": groups_from_float(torch.randn(100, 64))})
