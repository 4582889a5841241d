"""Insert the tree-attention plugin into a TensorRT network, and a one-layer test engine.

UNVERIFIED: TensorRT cannot be installed on the development machine and no GPU has run this.
Written from TensorRT's Python API (``INetworkDefinition.add_plugin`` with a
``tensorrt.plugin`` op, TensorRT >= 10.8). tensorrt is imported inside the functions only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from plugins.tree_attention.trt_plugin import PLUGIN_NAME, PLUGIN_NAMESPACE, AotOptions, register_tree_attention_plugin

log = logging.getLogger(__name__)

TRT_DTYPE_NAMES = ("float16", "bfloat16", "float32")


def add_tree_attention(network, q, k, v, prefix_len, mask_words, scale: float, options: AotOptions = AotOptions()):
    """Append a tree-attention layer to ``network`` and return its output ``trt.ITensor``.

    Inputs are ``trt.ITensor``s laid out as in the plugin contract (trt_plugin.py): q
    [B, H, n, D], k/v [B, Hkv, S, D], prefix_len [B] int32, mask_words [B, n, W] int32. The
    layer is added with ``aot=True`` so the built engine carries the kernel and needs no Python.
    """
    import tensorrt.plugin as trtp

    register_tree_attention_plugin(options)
    op = getattr(getattr(trtp.op, PLUGIN_NAMESPACE), PLUGIN_NAME)
    layer = network.add_plugin(op(q, k, v, prefix_len, mask_words, scale=float(scale)), aot=True)
    layer.name = "tree_attention"
    return layer.get_output(0)


@dataclass(frozen=True)
class EngineShapes:
    """Static shapes of the one-layer test engine."""

    batch: int
    num_heads: int
    num_kv_heads: int
    num_queries: int
    head_dim: int
    num_slots: int
    mask_words: int  # int32 words per mask row, ceil(region_len / 32)


def build_tree_attention_engine(
    shapes: EngineShapes, dtype: str, scale: float, options: AotOptions = AotOptions()
) -> bytes:
    """Serialize an engine holding only the plugin (static shapes, strongly typed network).

    For checking the plugin against the reference on a GPU machine with TensorRT installed.
    """
    if dtype not in TRT_DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {TRT_DTYPE_NAMES}, got {dtype!r}")
    import tensorrt as trt

    trt_dtype = {"float16": trt.float16, "bfloat16": trt.bfloat16, "float32": trt.float32}[dtype]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Strongly typed: the plugin's float type follows the inputs, no precision flags needed.
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    s = shapes
    q = network.add_input("q", trt_dtype, (s.batch, s.num_heads, s.num_queries, s.head_dim))
    k = network.add_input("k", trt_dtype, (s.batch, s.num_kv_heads, s.num_slots, s.head_dim))
    v = network.add_input("v", trt_dtype, (s.batch, s.num_kv_heads, s.num_slots, s.head_dim))
    prefix_len = network.add_input("prefix_len", trt.int32, (s.batch,))
    mask_words = network.add_input("mask_words", trt.int32, (s.batch, s.num_queries, s.mask_words))
    out = add_tree_attention(network, q, k, v, prefix_len, mask_words, scale, options)
    out.name = "out"
    network.mark_output(out)
    config = builder.create_builder_config()
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise RuntimeError("TensorRT failed to build the tree-attention test engine (see its log)")
    return bytes(engine)


def run_tree_attention_engine(engine_bytes: bytes, tensors: dict) -> None:
    """Run the test engine on CUDA torch tensors, in place into ``tensors["out"]``.

    ``tensors`` maps the engine's I/O names (q, k, v, prefix_len, mask_words, out) to
    contiguous CUDA tensors of the engine's shapes and dtypes.
    """
    import tensorrt as trt
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(engine_bytes)
    context = engine.create_execution_context()
    for name, tensor in tensors.items():
        context.set_tensor_address(name, tensor.data_ptr())
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("TensorRT execute_async_v3 failed")
    stream.synchronize()
