"""Tree attention as a TensorRT plugin: TensorRT's Python plugin API, ahead-of-time Triton kernel.

UNVERIFIED: TensorRT cannot be installed on the development machine and no GPU has run this
yet. Written from TensorRT's own ``tensorrt.plugin`` sources and its
``samples/python/quickly_deployable_plugins`` sample (TensorRT >= 10.8, AOT needs it).
``compile_aot_kernel`` (Triton only, no TensorRT, no GPU) is tested on CPU.

Why this route and not an IPluginV3 C++ wrapper:
- ``@trtp.aot_impl`` bakes the kernel's PTX into the serialized engine, so the engine runs in the
  plain C++ runtime (trtexec, Triton Inference Server's TensorRT backend) with no Python and no
  plugin library to preload; a C++ wrapper would need a CMake build against TensorRT headers
  plus a shared library loaded into every process that deserialises the engine.
- It is one kernel source: the Triton kernel the torch backend runs on CUDA and CI tests on CPU.
- The Python API produces an IPluginV3 under the hood, which TensorRT 11 still supports
  (it removed IPluginV2).
Costs: one kernel launch per plugin (so no split-KV combine launch: ``num_splits`` is 1), int32
scalar arguments only (the softmax scale is compiled in as a constant), and contiguous inputs.

Plugin contract (id ``trtssd::tree_attention``):
  inputs  q [B, H, n, D], k [B, Hkv, S, D], v [B, Hkv, S, D] (one dtype: fp16, bf16 or fp32),
          prefix_len [B] int32, mask_words [B, n, W] int32 (``trtssd.kernels.pack_mask``)
  output  [B, H, n, D] in q's dtype
  attrs   scale (float)
D must be static (known when the engine is built); everything else may be dynamic. Region bit
r of a query's mask row lets it see slot prefix_len + r (r < 32 * W, bounded by S).

Deliberately no ``from __future__ import annotations``: tensorrt.plugin inspects the
annotations of the decorated functions and needs real types, not strings.
"""

import logging
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from trtssd.kernels.packed_mask import BITS_PER_WORD

log = logging.getLogger(__name__)

PLUGIN_NAMESPACE = "trtssd"
PLUGIN_NAME = "tree_attention"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"

TENSOR_INPUTS = ("Q", "K", "V", "PrefixLen", "MaskWords")
SCALAR_ARGS = (
    "stride_qb", "stride_qh", "stride_qn",
    "stride_kb", "stride_kh", "stride_ks",
    "stride_vb", "stride_vh", "stride_vs",
    "stride_mb", "stride_mn",
    "stride_ob", "stride_oh", "stride_on",
    "num_queries", "num_kv_heads", "group_size", "num_slots", "region_len", "head_dim",
)  # fmt: skip
TRITON_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
STATIC_SMEM_LIMIT = 48 * 1024  # above this a launch must opt in to more dynamic shared memory


@dataclass(frozen=True)
class AotOptions:
    """Build-time launch choices of the plugin kernel (fixed per engine)."""

    block_m: int = 64  # rows (query head x token of one kv group) per program
    block_n: int = 64  # key slots per inner-loop step
    num_warps: int = 4
    num_stages: int = 2
    arch: int = 90  # compute capability x 10 of the PTX target (90: H100/H200)


@dataclass(frozen=True)
class AotKernel:
    """A compiled kernel as TensorRT launches it: entry name, PTX and launch needs."""

    name: str
    ptx: str
    num_warps: int
    shared_mem: int


def kernel_scalar_args(q_shape: Sequence, k_shape: Sequence, mask_shape: Sequence) -> tuple:
    """The kernel's int32 arguments for contiguous inputs, in kernel order (``SCALAR_ARGS``).

    Works on ints and on TensorRT shape expressions alike (only ``*`` and ``//`` are used).
    """
    _, H, n, D = q_shape
    _, Hkv, S, _ = k_shape
    _, _, W = mask_shape
    return (
        H * n * D, n * D, D,          # q
        Hkv * S * D, S * D, D,        # k
        Hkv * S * D, S * D, D,        # v
        n * W, W,                     # mask words
        H * n * D, n * D, D,          # out (q's layout)
        n, Hkv, H // Hkv, S, W * BITS_PER_WORD, D,
    )  # fmt: skip


def launch_grid(q_shape: Sequence, k_shape: Sequence, block_m: int, cdiv: Callable) -> tuple:
    """Grid of the single launch: (sequence x kv head, row blocks, 1)."""
    B, H, n, _ = q_shape
    Hkv = k_shape[1]
    return (B * Hkv, cdiv(H // Hkv * n, block_m), 1)


def _divisible_by_16_args(head_dim: int) -> list[str]:
    # TensorRT allocations are 256-byte aligned; strides that are multiples of head_dim are
    # multiples of 16 when head_dim is. The hints let Triton vectorise loads, as its JIT does.
    names = list(TENSOR_INPUTS) + ["Out"]
    if head_dim % 16 == 0:
        names += [a for a in SCALAR_ARGS if a.startswith(("stride_q", "stride_k", "stride_v", "stride_o"))]
    return names


def drop_unused_trailing_params(ptx: str, kernel_name: str, keep: int) -> str:
    """Cut the kernel's parameter list down to its first ``keep`` parameters.

    Triton >= 3.3 appends hidden pointer parameters (global and profile scratch) to every
    kernel; TensorRT's AOT launch passes exactly inputs + extra args + outputs, so the PTX must
    declare exactly those. Only parameters the body never reads are removed (else ValueError).
    """
    header = re.search(r"\.entry\s+" + re.escape(kernel_name) + r"\s*\((.*?)\)", ptx, re.S)
    if header is None:
        raise ValueError(f"no .entry {kernel_name} in the PTX")
    params = [p.strip() for p in header.group(1).split(",") if p.strip()]
    if len(params) < keep:
        raise ValueError(f"kernel {kernel_name} declares {len(params)} parameters, expected at least {keep}")
    for extra in params[keep:]:
        param_name = extra.split()[-1]
        if len(re.findall(re.escape(param_name) + r"\b", ptx)) != 1:
            raise ValueError(f"PTX parameter {param_name} is used by the kernel body; cannot drop it")
    new_header = ".entry " + kernel_name + "(\n\t" + ",\n\t".join(params[:keep]) + "\n)"
    return ptx[: header.start()] + new_header + ptx[header.end() :]


def compile_aot_kernel(dtype: str, head_dim: int, scale: float, options: AotOptions = AotOptions()) -> AotKernel:
    """Compile the single-launch tree-attention kernel to PTX for TensorRT (needs Triton only).

    dtype: "float16" | "bfloat16" | "float32"; head_dim: the static D; scale: softmax scale.
    """
    if dtype not in TRITON_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TRITON_DTYPES)}, got {dtype!r}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    from trtssd.kernels.tree_attention_triton import LOG2E, MAX_HEAD_DIM, KernelConfig, tree_attention_fwd

    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    KernelConfig(options.block_m, options.block_n, 1, options.num_warps, options.num_stages)  # validates
    elem = TRITON_DTYPES[dtype]
    fn = JITFunction(tree_attention_fwd)
    signature = {name: f"*{elem}" for name in ("Q", "K", "V")}
    signature.update({"PrefixLen": "*i32", "MaskWords": "*i32", "KvRows": "constexpr"})
    signature.update({name: "i32" for name in SCALAR_ARGS})
    signature.update({"Out": f"*{elem}", "PartAcc": "constexpr", "PartStats": "constexpr"})
    constexprs = {
        "KvRows": None,  # inputs are per-sequence K/V, not a pool
        "PartAcc": None,  # split-KV workspace: unused with one split, so compiled away
        "PartStats": None,
        "SCALE_LOG2": scale * LOG2E,
        "BLOCK_M": options.block_m,
        "BLOCK_N": options.block_n,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "NUM_SPLITS": 1,
        "INPUT_PRECISION": "ieee" if dtype == "float32" else None,
        "WIDEN_DOT": False,
    }
    for name in constexprs:
        signature.setdefault(name, "constexpr")
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in _divisible_by_16_args(head_dim)}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", options.arch, 32),
        options={"num_warps": options.num_warps, "num_stages": options.num_stages, "enable_fp_fusion": True},
    )
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError("the kernel needs Triton scratch memory, which a TensorRT AOT launch cannot provide")
    if meta.shared > STATIC_SMEM_LIMIT:
        log.warning(
            "tree-attention kernel uses %d bytes of shared memory (> 48 KiB); if TensorRT does not raise "
            "the kernel's dynamic shared-memory limit the launch fails: lower block_n or num_stages",
            meta.shared,
        )
    keep = len(TENSOR_INPUTS) + len(SCALAR_ARGS) + 1  # + Out
    ptx = drop_unused_trailing_params(compiled.asm["ptx"], meta.name, keep)
    return AotKernel(name=meta.name, ptx=ptx, num_warps=meta.num_warps, shared_mem=meta.shared)


def _already_registered(trtp) -> bool:
    try:
        getattr(getattr(trtp.op, PLUGIN_NAMESPACE), PLUGIN_NAME)
    except AttributeError:
        return False
    return True


def register_tree_attention_plugin(options: AotOptions = AotOptions()) -> None:
    """Register ``trtssd::tree_attention`` with TensorRT's plugin registry (UNVERIFIED).

    Needed only while *building* an engine; an engine built with ``aot=True`` carries its PTX
    and runs without this module. Idempotent; the options of the first call in a process win.
    """
    import tensorrt as trt
    import tensorrt.plugin as trtp
    from typing import Tuple, Union, List

    if _already_registered(trtp):
        return
    dtype_names = {trt.float16: "float16", trt.bfloat16: "bfloat16", trt.float32: "float32"}

    @trtp.register(PLUGIN_ID)
    def tree_attention_shape(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        prefix_len: trtp.TensorDesc,
        mask_words: trtp.TensorDesc,
        scale: float,
    ) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(PLUGIN_ID)
    def tree_attention_formats(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        prefix_len: trtp.TensorDesc,
        mask_words: trtp.TensorDesc,
        outputs: Tuple[trtp.TensorDesc],
    ) -> List[trtp.AutoTuneCombination]:
        # "|" ties positions together: q, k, v and the output share one float type.
        floats = "FP16|BF16|FP32"
        return [trtp.AutoTuneCombination(f"{floats}, {floats}, {floats}, INT32, INT32, {floats}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def tree_attention_aot(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        prefix_len: trtp.TensorDesc,
        mask_words: trtp.TensorDesc,
        scale: float,
        outputs: Tuple[trtp.TensorDesc],
        tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        head_dim_expr = q.shape_expr[3]
        if not head_dim_expr.is_constant:
            raise ValueError("tree_attention plugin: head_dim (q.shape[3]) must be static")
        kernel = compile_aot_kernel(dtype_names[q.dtype], head_dim_expr.constant_value(), scale, options)
        grid = launch_grid(q.shape_expr, k.shape_expr, options.block_m, trtp.cdiv)
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = grid
        launch.block_x = kernel.num_warps * 32
        launch.shared_mem = kernel.shared_mem
        scalars = kernel_scalar_args(q.shape_expr, k.shape_expr, mask_words.shape_expr)
        extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
        return kernel.name.encode(), kernel.ptx.encode(), launch, extra_args
