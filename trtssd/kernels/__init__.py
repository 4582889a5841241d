"""GPU kernels and their host-side helpers.

- ``packed_mask``: bit-packing of region masks (TensorRT-LLM's spec-decoding layout); pure torch.
- ``tree_attention_triton``: the fused tree-attention Triton kernel and its torch-callable
  wrapper. It needs the optional ``triton`` package (extra ``kernels``), so it is not imported
  here; ``load_tree_attention_kernel`` imports it on first use.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

from trtssd.kernels.packed_mask import pack_mask, packed_width, unpack_mask

log = logging.getLogger(__name__)

__all__ = ["load_tree_attention_kernel", "pack_mask", "packed_width", "unpack_mask"]


@functools.cache
def load_tree_attention_kernel() -> Callable | None:
    """The Triton tree-attention wrapper, or None (logged once) when triton is not installed."""
    try:
        from trtssd.kernels.tree_attention_triton import tree_attention_triton
    except ImportError as exc:
        log.warning("triton unavailable (%s): tree attention on CUDA falls back to torch SDPA", exc)
        return None
    return tree_attention_triton
