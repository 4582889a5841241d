"""Int8 projections: int8 weights, activations quantized to 8 bits per row at each forward.

Each projection keeps its weight as int8 with one symmetric scale per output channel and runs
through fbgemm's dynamic linear (``quantized::linear_dynamic``), which quantizes its input,
multiplies in int8 with int32 accumulation and dequantizes to fp32; the bias is added after, in
fp32.

fbgemm measures one activation range over all the rows of a call. We give every row its own:
each row is divided by its absolute maximum and an anchor row spanning [-1, 1] joins the call,
so the range fbgemm measures is [-1, 1] whatever the rows are. Integer accumulation is exact,
so a row's output is then the same bit for bit alone or among any other rows. A target needs
that: its verify of K+1 rows must compute what its one-row decode computes, or greedy sd could
part from greedy ar.

Activations get 7 bits (so AVX2's 8-bit multiply-add cannot saturate int16). That is enough for
a draft (one level). A target can take two levels: the row's 7-bit code and, as a second row of
the same call, its rounding remainder scaled up to the full range, for ~14 bits at the price of
twice the rows. On Qwen2.5-Coder-1.5B the KL from fp32's next-token distribution falls from
0.066 to 0.0024 (what remains is the int8 weights; docs/draft.md).

Why int8 (measured on the 2-core AMD EPYC here, one thread, docs/draft.md): int8 reads each weight
once for any number of rows and multiplies 32 bytes per instruction, where the CPU int4 kernel
unpacks nibbles to bf16 on AVX2 and grows with rows.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from trtssd.models.config import ModelConfig
from trtssd.models.llama import LlamaModel, linear_names

log = logging.getLogger(__name__)

# x86's 8-bit multiply-add (vpmaddubsw) saturates int16 with full-range activations; fbgemm's
# documented remedy is 7-bit activations.
REDUCE_RANGE = True
ACTIVATION_LEVELS = (1, 2)
# fbgemm quantizes the anchor's [-1, 1] onto 127 steps of STEP, one end at 63 steps and the other
# at 64 (its zero point). Rows are scaled into [-ROW_RANGE, ROW_RANGE], so every value rounds to
# at most 63 steps either way and no value is clipped: we then know each value's code exactly.
STEP = 2.0 / 127.0
ROW_RANGE = 0.99
# The second level carries the remainder (at most STEP / 2) scaled up into the same range.
REMAINDER_GAIN = 2.0 * ROW_RANGE / STEP


def rowwise_linear_dynamic(x: torch.Tensor, int8_params, levels: int = 1) -> torch.Tensor:
    """x [rows, in] fp32 @ the packed int8 weight, no bias, each row with its own activation
    scale (see the module docstring); ``levels`` 2 adds each row's rounding remainder.
    trtssd/kernels/draft_layers.cpp (Int8Projections) does the same ops in the same order."""
    rows = x.shape[0]
    absmax = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    unit = x / absmax * ROW_RANGE
    anchor = x.new_zeros(1, x.shape[1])
    anchor[0, 0], anchor[0, -1] = 1.0, -1.0
    parts = [unit]
    if levels == 2:
        parts.append((unit - torch.round(unit / STEP) * STEP) * REMAINDER_GAIN)
    y = torch.ops.quantized.linear_dynamic(torch.cat([*parts, anchor]), int8_params, REDUCE_RANGE)
    out = y[:rows]
    if levels == 2:
        out = out + y[rows:2 * rows] / REMAINDER_GAIN
    return out * (absmax / ROW_RANGE)


_NO_ENGINE = ("this torch build has no fbgemm/x86 quantized engine: int8 projections need one "
              f"(supported: {torch.backends.quantized.supported_engines})")


def int8_available() -> bool:
    """Whether this torch build has a CPU engine for quantized dynamic linears (fbgemm / x86)."""
    return bool({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines))


class Int8DynamicLinear(nn.Module):
    """y = x @ W.T + b with W as per-output-channel symmetric int8; x quantized per row per call,
    in ``activation_levels`` levels of 7 bits."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 activation_levels: int = 1) -> None:
        """codes int8 [out, in] and scales float64 [out]: a weight as ``quantize_weight`` makes it."""
        super().__init__()
        if activation_levels not in ACTIVATION_LEVELS:
            raise ValueError(f"activation_levels must be one of {ACTIVATION_LEVELS}, got {activation_levels!r}")
        if codes.dtype != torch.int8 or codes.dim() != 2 or tuple(scales.shape) != (codes.shape[0],):
            raise ValueError(f"expected int8 codes [out, in] and one scale per row; got {codes.dtype} "
                             f"{tuple(codes.shape)} and scales {tuple(scales.shape)}")
        self.activation_levels = activation_levels
        self.out_features, self.in_features = codes.shape
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # torch 2.13 marks quantized tensor creation as deprecated; fbgemm's prepack still
            # takes only a quantized weight, and the packed result holds no quantized tensor.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(codes, scales.double(), zero_points, 0)
            # No bias inside: fbgemm would add it before the row's scale is multiplied back.
            self.int8_params = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else bias.detach().to(device="cpu", dtype=torch.float32).contiguous()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    activation_levels: int = 1) -> "Int8DynamicLinear":
        """Quantized from an fp32 weight [out, in]."""
        return cls(*quantize_weight(weight), bias, activation_levels)

    @classmethod
    def from_linear(cls, module: nn.Module, activation_levels: int = 1) -> "Int8DynamicLinear":
        weight = getattr(module, "weight", None)
        if weight is None or weight.numel() == 0:
            raise ValueError(f"{type(module).__name__} holds no plain weight to quantize")
        return cls.from_weight(weight, getattr(module, "bias", None), activation_levels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32)
        y = rowwise_linear_dynamic(flat, self.int8_params, self.activation_levels)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic, "
                f"{self.activation_levels} activation level(s)")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [out, in], scales float64 [out]): ``weight`` rounded to int8 with one symmetric
    scale per output channel (its absolute maximum over 127). The codes are what
    ``torch.quantize_per_channel`` makes (round(w / scale), from the fp32 inverse scale), computed
    with plain tensor ops, which run on every core (the quantize call did not: 21 s for the 1.5B)."""
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny).double()
    inverse = (1.0 / scales).float().unsqueeze(1)
    return torch.round(w * inverse).clamp_(-128, 127).to(torch.int8), scales


def int8_checkpoint(cfg: ModelConfig, state: Mapping[str, torch.Tensor],
                    progress: Callable[[Iterable[str]], Iterable[str]] = iter) -> dict[str, torch.Tensor]:
    """What an engine stores for a side run with int8 projections, from its fp32 state dict (our
    parameter layout): ``int8.<linear>.codes`` and ``.scales`` for every projection (a tied head
    quantizes the embedding) and ``param.<name>`` for the rest (embedding, norms, biases), so
    that loading only packs (``load_int8_model``). ``progress`` wraps the loop over projections."""
    rest = dict(state)
    tensors = {}
    for name in progress(linear_names(cfg)):
        weight = state["embed.weight"] if name == "lm_head" and cfg.tie_word_embeddings else rest.pop(f"{name}.weight")
        tensors[f"int8.{name}.codes"], tensors[f"int8.{name}.scales"] = quantize_weight(weight)
    tensors.update({f"param.{k}": v.to(torch.float32).contiguous() for k, v in rest.items()})
    return tensors


def load_int8_model(stored: Mapping[str, torch.Tensor], cfg: ModelConfig, activation_levels: int) -> LlamaModel:
    """The model an ``int8_checkpoint`` describes: weights packed for fbgemm, nothing re-quantized,
    so its projections are those of ``quantize_linears_int8`` on the fp32 model, bit for bit."""
    if not int8_available():
        raise RuntimeError(_NO_ENGINE)

    def stored_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        try:
            codes, scales = stored[f"int8.{name}.codes"], stored[f"int8.{name}.scales"]
        except KeyError as err:
            raise ValueError(f"int8 weights lack {err}; rebuild the engine") from None
        return Int8DynamicLinear(codes, scales, stored.get(f"param.{name}.bias"), activation_levels)

    model = LlamaModel(cfg, stored_linear)
    linears = set(linear_names(cfg))
    # Projection biases live in their Int8DynamicLinear; the rest are the model's parameters.
    model.load_weights({k[len("param."):]: v for k, v in stored.items()
                        if k.startswith("param.") and k[len("param."):].rpartition(".")[0] not in linears})
    return model.eval()


def quantize_linears_int8(model: LlamaModel, activation_levels: int = 1) -> int:
    """Replace every projection of ``model`` (attention, MLP and output head) by an
    ``Int8DynamicLinear`` of its fp32 weight; returns how many were replaced."""
    if not int8_available():
        raise RuntimeError(_NO_ENGINE)
    count = 0
    for name, module in list(model.linears()):
        model.set_linear(name, Int8DynamicLinear.from_linear(module, activation_levels))
        count += 1
    return count
