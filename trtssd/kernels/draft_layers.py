"""The draft's decoder layers as one compiled call (CPU), for few-row forwards.

Why: at one row the draft reads its weights (~80 MB of 4-bit SmolLM2 weights, ~11 ms on one core)
but spent about as long again on ~900 small aten calls per step (norms, RoPE, KV writes, masked
SDPA, dtype casts, each with dispatch and Python overhead). ``draft_layers.cpp`` runs a whole
step's layers in one C++ call: the same projections as the torch layers (our int4 matmul,
``int4_matmul.cpp``, or fbgemm's int8 dynamic linear, fp32 in and out), with the norms, RoPE, KV
writes, attention and SiLU as plain loops in fp32. The result matches the torch path up to float
summation order (tests/test_draft_layers.py).

The extension is compiled on first use (``cpu_extension``). Prefill and wide tree steps stay on
the torch path: the direct attention loop is not a GEMM, so it loses to SDPA once many queries
share the keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from trtssd.kernels.cpu_extension import load_extension
from trtssd.kernels.int4_matmul import Int4KernelWeight

log = logging.getLogger(__name__)

# Forwards up to this many tokens take the fused path; wider ones the torch layers, whose
# projections switch to fp32 GEMMs above the same row count (models.quant.DENSE_ABOVE_ROWS; docs/draft.md).
DEFAULT_MAX_TOKENS = 16


def projection_kind(module) -> str | None:
    """"int4", "int8" or None: which compiled projection ``module`` can run as. Checked by the
    weights it holds, not by class, so that kernels stay below the model code that uses them
    (models.quant.Int4Linear: an Int4KernelWeight; models.int8_dynamic.Int8DynamicLinear:
    int8_params)."""
    if isinstance(getattr(module, "kernel_weight", None), Int4KernelWeight):
        return "int4"
    if isinstance(getattr(module, "int8_params", None), torch.ScriptObject):
        return "int8"
    return None


def ineligible_reason(model) -> str | None:
    """Why ``model`` cannot use the fused layers, or None when it can."""
    cfg = model.config
    if model.device.type != "cpu":
        return f"model is on {model.device}, the fused layers are CPU code"
    if model.dtype != torch.float32:
        return f"model dtype is {model.dtype}, the fused layers keep an fp32 residual stream"
    if cfg.qk_norm:
        return "q/k norms are not implemented in the fused layers"
    kinds = set()
    for name, module in model.linears():
        if name == "lm_head":
            continue
        kind = projection_kind(module)
        if kind is None:
            return f"{name} is {type(module).__name__}, neither Int4Linear nor Int8DynamicLinear"
        kinds.add(kind)
    if len(kinds) > 1:
        return "the projections mix int4 and int8"
    levels = {getattr(module, "activation_levels", None) for name, module in model.linears() if name != "lm_head"}
    if len(levels) > 1:
        return "the int8 projections mix activation levels"
    return None


@dataclass
class FusedDraftLayers:
    """Every decoder layer of an int4 or int8 ``LlamaModel`` as one extension call (see module
    docstring).

    Holds references to the model's own weights (no copies). ``max_tokens``: the widest forward
    it takes; ``LlamaModel.forward`` uses the torch layers for wider ones.
    """

    kind: str  # "int4" or "int8"
    norms: list[torch.Tensor]
    projections: list  # int4: (nibbles, scales, mins, bias) lists; int8: ext.Int8Projections
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    max_tokens: int = DEFAULT_MAX_TOKENS

    @classmethod
    def from_model(cls, model, max_tokens: int = DEFAULT_MAX_TOKENS) -> "FusedDraftLayers":
        """Raises ValueError when the model is not eligible (``ineligible_reason``), and whatever
        the compiler raises when the extension cannot be built."""
        reason = ineligible_reason(model)
        if reason is not None:
            raise ValueError(f"fused draft layers unavailable: {reason}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        ext = load_extension()
        cfg = model.config
        norms, projections = [], []
        for layer in model.layers:
            norms += [layer.attn_norm.weight.data, layer.mlp_norm.weight.data]
            projections += [layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down]
        kind = projection_kind(projections[0])
        if kind == "int8":
            weights = ext.Int8Projections(
                [p.int8_params for p in projections],
                [torch.empty(0) if p.bias is None else p.bias for p in projections],
                projections[0].activation_levels,
            )
        else:
            weights = (
                [p.kernel_weight.nibbles for p in projections], [p.kernel_weight.scales for p in projections],
                [p.kernel_weight.mins for p in projections],
                [torch.empty(0) if p.bias is None else p.bias.data.float().contiguous() for p in projections],
            )
        return cls(kind, norms, weights, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                   cfg.rms_norm_eps, max_tokens)

    def accepts(self, tokens: int, batch) -> bool:
        return tokens <= self.max_tokens and batch.visible is not None

    def __call__(self, x: torch.Tensor, batch, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor:
        """x [T, hidden] fp32 (embedded tokens) -> hidden states after the last layer; writes
        every token's K/V into ``kv`` like the torch layers."""
        T = x.shape[0]
        visible = batch.visible
        if batch.num_seqs == 1:
            visible = visible[0]
        else:
            visible = visible.reshape(-1, visible.shape[-1]).index_select(0, batch.unpad_index)
        ext = load_extension()
        run = ext.decoder_layers_int8 if self.kind == "int8" else ext.decoder_layers_int4
        weights = (self.projections,) if self.kind == "int8" else self.projections
        return run(
            x.contiguous(), self.norms, *weights, [k for k, _ in kv], [v for _, v in kv],
            cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous(),
            batch.cache_rows.contiguous(), batch.slots.contiguous(), visible.contiguous(),
            self.heads, self.kv_heads, self.head_dim, self.intermediate, self.eps, self.head_dim**-0.5,
        )
