"""The int4 draft's decoder layers as one compiled call (CPU), for few-row forwards.

Why: at one row the draft reads ~80 MB of 4-bit weights (~11 ms on one core here) but spent about
as long again on ~900 small aten calls per step (norms, RoPE, KV writes, masked SDPA, dtype casts,
each with dispatch and Python overhead). ``int4_draft.cpp`` runs a whole step's layers in one C++
call: the same int4 matmuls (aten's kernel, bf16 in and out), with the norms, RoPE, KV writes,
attention and SiLU as plain loops in fp32. The result matches the torch path up to float
summation order (tests/test_int4_draft.py).

The extension is compiled on first use with torch's C++ extension builder (ninja + the system
C++ compiler, ~1 minute) and cached under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``). Prefill and wide tree steps stay on the torch path: the direct
attention loop is not a GEMM, so it loses to SDPA once many queries share the keys.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_draft.cpp")
# Forwards up to this many tokens take the fused path; wider ones the torch layers, whose
# projections switch to fp32 GEMMs above the same row count (models.quant.DENSE_ABOVE_ROWS; docs/draft.md).
DEFAULT_MAX_TOKENS = 16


@functools.lru_cache(maxsize=1)
def load_extension():
    """Compile (once per machine, cached by torch) and import the C++ extension."""
    from torch.utils.cpp_extension import load

    with _interpreter_bin_first_on_path():
        return load(
            name="trtssd_int4_draft",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            verbose=False,
        )


@contextlib.contextmanager
def _interpreter_bin_first_on_path():
    """Always build with the ninja installed next to this interpreter (our dependency): two
    ninja versions read each other's build log as stale, so a system ninja on PATH in some
    processes and ours in others made every load recompile (35-150 s)."""
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{old}"
    try:
        yield
    finally:
        os.environ["PATH"] = old


def ineligible_reason(model) -> str | None:
    """Why ``model`` cannot use the fused layers, or None when it can."""
    cfg = model.config
    if model.device.type != "cpu":
        return f"model is on {model.device}, the fused layers are CPU code"
    if model.dtype != torch.float32:
        return f"model dtype is {model.dtype}, the fused layers keep an fp32 residual stream"
    if cfg.qk_norm:
        return "q/k norms are not implemented in the fused layers"
    for name, module in model.linears():
        if name == "lm_head":
            continue
        # The fused layers read an Int4Linear's packed weights; checked by those attributes, not
        # by class, so that kernels stay below the model code that uses them.
        if not (hasattr(module, "packed") and hasattr(module, "scale_zeros")):
            return f"{name} is {type(module).__name__}, not Int4Linear (no packed int4 weights)"
    return None


@dataclass
class FusedInt4Layers:
    """Every decoder layer of an int4 ``LlamaModel`` as one extension call (see module docstring).

    Holds references to the model's own weights (no copies). ``max_tokens``: the widest forward
    it takes; ``LlamaModel.forward`` uses the torch layers for wider ones.
    """

    norms: list[torch.Tensor]
    packed: list[torch.Tensor]
    scale_zeros: list[torch.Tensor]
    biases: list[torch.Tensor]  # fp32, empty for a projection without one
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    max_tokens: int = DEFAULT_MAX_TOKENS

    @classmethod
    def from_model(cls, model, max_tokens: int = DEFAULT_MAX_TOKENS) -> "FusedInt4Layers":
        """Raises ValueError when the model is not eligible (``ineligible_reason``), and whatever
        the compiler raises when the extension cannot be built."""
        reason = ineligible_reason(model)
        if reason is not None:
            raise ValueError(f"fused int4 layers unavailable: {reason}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        load_extension()
        cfg = model.config
        norms, packed, scale_zeros, biases = [], [], [], []
        for layer in model.layers:
            norms += [layer.attn_norm.weight.data, layer.mlp_norm.weight.data]
            for proj in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down):
                packed.append(proj.packed)
                scale_zeros.append(proj.scale_zeros)
                biases.append(torch.empty(0) if proj.bias is None else proj.bias.data.float().contiguous())
        return cls(norms, packed, scale_zeros, biases, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size, cfg.rms_norm_eps, max_tokens)

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
        return load_extension().decoder_layers(
            x.contiguous(), self.norms, self.packed, self.scale_zeros, self.biases,
            [k for k, _ in kv], [v for _, v in kv],
            cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous(),
            batch.cache_rows.contiguous(), batch.slots.contiguous(), visible.contiguous(),
            self.heads, self.kv_heads, self.head_dim, self.intermediate, self.eps, self.head_dim**-0.5,
        )
