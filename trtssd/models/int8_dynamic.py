"""Int8 projections for a draft: int8 weights, activations quantized to 8 bits at each forward.

Each projection keeps its weight as int8 with one symmetric scale per output channel and runs
through fbgemm's dynamic linear (``quantized::linear_dynamic``): every forward quantizes its input
(one scale over the call's rows, 7-bit range so the AVX2 multiply-add cannot saturate),
multiplies in int8 with int32 accumulation and dequantizes to fp32, adding the bias in fp32.

Why (measured on the 2-core AMD EPYC here, one thread, docs/draft.md): int8 reads each weight
once for any number of rows and multiplies 32 bytes per instruction, where the CPU int4 kernel
unpacks nibbles to bf16 on AVX2 and grows with rows. On Qwen2.5-Coder-0.5B a one-row draft
forward costs 59 ms against int4's 78 (compiled layers), twelve rows 122 against 334.

The activation scale is shared by the rows of one call, so a row's logits depend slightly on the
rows beside it. Exactness does not mind: every proposal is verified against the q it was drawn
from, and the target never runs these layers.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from trtssd.models.llama import LlamaModel

log = logging.getLogger(__name__)

# x86's 8-bit multiply-add (vpmaddubsw) saturates int16 with full-range activations; fbgemm's
# documented remedy is 7-bit activations.
REDUCE_RANGE = True


def int8_available() -> bool:
    """Whether this torch build has a CPU engine for quantized dynamic linears (fbgemm / x86)."""
    return bool({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines))


class Int8DynamicLinear(nn.Module):
    """y = x @ W.T + b with W as per-output-channel symmetric int8; x quantized per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().to(device="cpu", dtype=torch.float32)
        self.out_features, self.in_features = w.shape
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny).double()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        b = None if bias is None else bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
        with warnings.catch_warnings():
            # torch 2.13 marks quantized tensor creation as deprecated; fbgemm's prepack still
            # takes only a quantized weight, and the packed result holds no quantized tensor.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
            self.int8_params = torch.ops.quantized.linear_prepack(qweight, b)  # fbgemm packed weight + bias

    @classmethod
    def from_linear(cls, module: nn.Module) -> "Int8DynamicLinear":
        weight = getattr(module, "weight", None)
        if weight is None or weight.numel() == 0:
            raise ValueError(f"{type(module).__name__} holds no plain weight to quantize")
        return cls(weight, getattr(module, "bias", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.ops.quantized.linear_dynamic(flat, self.int8_params, REDUCE_RANGE)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic"


def quantize_linears_int8(model: LlamaModel) -> int:
    """Replace every projection of ``model`` (attention, MLP and output head) by an
    ``Int8DynamicLinear`` of its fp32 weight; returns how many were replaced."""
    if not int8_available():
        raise RuntimeError("this torch build has no fbgemm/x86 quantized engine: the int8 draft needs one "
                           f"(supported: {torch.backends.quantized.supported_engines})")
    count = 0
    for name, module in list(model.linears()):
        model.set_linear(name, Int8DynamicLinear.from_linear(module))
        count += 1
    return count
