"""Fused tree attention in Triton: one kernel launch for a whole decode / verify / tree step.

Semantics are those of ``trtssd.models.attention.tree_attention_reference``: every query sees
its sequence's committed prefix (slots ``[0, prefix_len)``) in full and region slot
``prefix_len + r`` iff bit ``r`` of its packed mask row is set; grouped-query heads.

Work split. One program owns one (sequence, kv head) pair and a block of ``BLOCK_M`` *rows*,
where a row is one (query head of that kv group, query token) pair. With Llama shapes
(4 query heads per kv head) and 8..32 new tokens, all rows of a (sequence, kv head) fit in one
program, so the prefix K/V of that head is streamed from memory exactly once per step, not once
per query head or per token. Scores use fp32 accumulation (``tl.dot``) and an online softmax in
base 2; probabilities are rounded to the value dtype for the second product, as flash attention
does.

Launches. ``num_splits == 1`` (the default whenever the grid already fills the GPU, and the only
mode of the TensorRT plugin) is a single fused launch. At small batch a (sequence, kv head) grid
leaves most SMs idle while one long prefix streams, so ``num_splits > 1`` additionally cuts each
key range into that many pieces and merges the partial softmax states in a second, tiny launch
(flash-decoding style).

CPU. The same kernel source runs under Triton's interpreter, which is how CI tests it. Triton
decides at its own first import whether its language library is interpreted
(``TRITON_INTERPRET=1`` set before ``import triton``); this module never reads the variable, it
asks Triton which mode it is in (``interpreter_active``) when a kernel is first launched.

GPU status: UNVERIFIED on a GPU until scripts/gpu_check.sh has run (see docs/gpu.md). On CPU it
is checked against the reference under the interpreter (tests/test_tree_attention_triton.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from trtssd.kernels.packed_mask import BITS_PER_WORD, pack_mask, packed_width

LOG2E = 1.4426950408889634
WORD_BITS = tl.constexpr(BITS_PER_WORD)  # globals read inside a Triton kernel must be constexpr
MAX_HEAD_DIM = 256  # one program holds a [BLOCK_M, head_dim] fp32 accumulator in registers
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Kernels. Plain functions, wrapped into a compiled or an interpreted Triton function on first
# use (see _kernels). Argument order (input tensors, int32 scalars, output tensors, constexprs)
# is the one TensorRT's ahead-of-time plugin launch uses, so the plugin reuses this source.
# ---------------------------------------------------------------------------------------------


def tree_attention_fwd(
    Q, K, V, PrefixLen, MaskWords, KvRows,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mn,
    stride_ob, stride_oh, stride_on,
    num_queries, num_kv_heads, group_size, num_slots, region_len, head_dim,
    Out, PartAcc, PartStats,
    SCALE_LOG2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bh // num_kv_heads).to(tl.int64)  # int64: batch offsets of a big cache pass 2**31
    kv_head = pid_bh % num_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group_size * num_queries
    head = kv_head * group_size + rows // num_queries
    query = rows % num_queries
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim

    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qn + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if WIDEN_DOT:  # Triton's interpreter gets bf16 tl.dot wrong; fp32 gives the same products
        q = q.to(tl.float32)
    if KvRows is None:
        kv_b = b
    else:  # sequence b's keys live in row KvRows[b] of a larger pool
        kv_b = tl.load(KvRows + b).to(tl.int64)
    k_base = K + kv_b * stride_kb + kv_head * stride_kh
    v_base = V + kv_b * stride_vb + kv_head * stride_vh
    mask_rows = MaskWords + b * stride_mb + query * stride_mn

    prefix = tl.load(PrefixLen + b).to(tl.int32)
    end = tl.minimum(prefix + region_len, num_slots)  # slots past the cache never exist
    if NUM_SPLITS == 1:
        lo = 0
        hi = end
    else:
        span = tl.cdiv(tl.cdiv(end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * span
        hi = tl.minimum(lo + span, end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        slot_ok = slots < hi
        kv_mask = slot_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_base + slots[:, None] * stride_ks + dims[None, :], mask=kv_mask, other=0.0)
        if WIDEN_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * SCALE_LOG2

        # Prefix slots are visible to all; region slot r only where mask bit r is set. The
        # word load is fully masked off for blocks inside the prefix, so it costs no traffic.
        rel = slots - prefix
        in_region = (rel >= 0) & slot_ok
        rel = tl.where(in_region, rel, 0)
        words = tl.load(
            mask_rows[:, None] + (rel // WORD_BITS)[None, :],
            mask=row_ok[:, None] & in_region[None, :],
            other=0,
        )
        bit_set = ((words >> (rel % WORD_BITS)[None, :]) & 1) != 0
        in_prefix = (slots < prefix) & slot_ok
        s = tl.where(in_prefix[None, :] | bit_set, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vs + dims[None, :], mask=kv_mask, other=0.0)
        p = p.to(v.dtype)  # rounded like a half-precision kernel, even when widened below
        if WIDEN_DOT:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=INPUT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        o_ptrs = Out + b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_on + dims[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (pid_bh * tl.num_programs(1) + pid_m) * NUM_SPLITS + split
        offs_m = tl.arange(0, BLOCK_M)
        tl.store(PartAcc + (part * BLOCK_M + offs_m[:, None]) * BLOCK_D + dims[None, :], acc)
        tl.store(PartStats + (part * 2) * BLOCK_M + offs_m, m_i)
        tl.store(PartStats + (part * 2 + 1) * BLOCK_M + offs_m, l_i)


def tree_attention_combine(
    PartAcc, PartStats,
    stride_ob, stride_oh, stride_on,
    num_queries, num_kv_heads, group_size, head_dim,
    Out,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Merge the per-split softmax states (max m, sum l, unnormalised acc) of one row block."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kv_head = pid_bh % num_kv_heads
    offs_m = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    first = (pid_bh * tl.num_programs(1) + pid_m) * NUM_SPLITS

    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(PartStats + ((first + split) * 2) * BLOCK_M + offs_m))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for split in range(NUM_SPLITS):
        part = first + split
        weight = tl.exp2(tl.load(PartStats + (part * 2) * BLOCK_M + offs_m) - m_safe)
        l_sum += weight * tl.load(PartStats + (part * 2 + 1) * BLOCK_M + offs_m)
        acc += weight[:, None] * tl.load(PartAcc + (part * BLOCK_M + offs_m[:, None]) * BLOCK_D + dims[None, :])

    rows = pid_m * BLOCK_M + offs_m
    row_ok = rows < group_size * num_queries
    head = kv_head * group_size + rows // num_queries
    query = rows % num_queries
    out = acc / l_sum[:, None]
    o_ptrs = Out + b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_on + dims[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (dims < head_dim)[None, :])


class _Kernels(NamedTuple):
    fwd: object
    combine: object


def interpreter_active() -> bool:
    """True when this process's triton.language was built for the CPU interpreter.

    Triton fixes that at its first import (``TRITON_INTERPRET=1``); a kernel must run in the
    same mode as the library functions it calls, so the mode is read from the library itself.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


@functools.cache
def _kernels(interpret: bool) -> _Kernels:
    """The kernels as Triton functions, built on first use in the process's Triton mode.

    Built here rather than with ``@triton.jit`` at import, whose choice follows the environment
    at decoration time and could disagree with the library's mode. Cached because Triton keeps
    its compiled binaries on the function object.
    """
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as wrap
    else:
        from triton.runtime.jit import JITFunction as wrap
    return _Kernels(wrap(tree_attention_fwd), wrap(tree_attention_combine))


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters. Block sizes are powers of two >= 16 (the tensor-core minimum)."""

    block_m: int = 64  # rows (query head x query token of one kv group) per program
    block_n: int = 64  # key slots per inner-loop step
    num_splits: int = 1  # key-range pieces per row block; > 1 adds a combine launch
    num_warps: int = 4
    num_stages: int = 2  # software-pipelining depth of the K/V loads (GPU only)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not (_is_pow2(value) and 16 <= value <= 256):
                raise ValueError(f"{name} must be a power of two in [16, 256], got {value}")
        if not 1 <= self.num_splits <= 128:
            raise ValueError(f"num_splits must be in [1, 128], got {self.num_splits}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be in [1, 6], got {self.num_stages}")


@dataclass(frozen=True)
class Problem:
    """The shapes of one call, as the launch heuristics see them."""

    batch: int
    num_heads: int
    num_kv_heads: int
    num_queries: int
    head_dim: int
    num_slots: int
    region_len: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rows(self) -> int:
        return self.group_size * self.num_queries


def default_config(problem: Problem, sm_count: int | None) -> KernelConfig:
    """Heuristic launch parameters; ``sm_count`` None means the CPU interpreter.

    Untuned: the GPU numbers here are first guesses until scripts/gpu_check.py's sweep has run.
    """
    block_m = min(128, max(16, triton.next_power_of_2(problem.rows)))
    if sm_count is None:
        return KernelConfig(block_m=block_m, block_n=32, num_splits=1, num_warps=4, num_stages=1)
    block_n = 64 if problem.head_dim <= 128 else 32
    programs = problem.batch * problem.num_kv_heads * triton.cdiv(problem.rows, block_m)
    splits = 1
    if programs < sm_count:
        # Enough programs for ~2 waves, but every split keeps at least 2 key blocks of work.
        max_useful = max(1, problem.num_slots // (2 * block_n))
        splits = max(1, min(triton.cdiv(2 * sm_count, programs), max_useful, 64))
    return KernelConfig(
        block_m=block_m,
        block_n=block_n,
        num_splits=splits,
        num_warps=4 if block_m <= 64 else 8,
        num_stages=2,
    )


def _check_inputs(q, k, v, prefix_len, mask_words, region_len: int, kv_rows) -> Problem:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be 4-D [B, H, n, D] / [B, Hkv, S, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    B, H, n, D = q.shape
    _, Hkv, S, _ = k.shape
    if k.shape[3] != D or (kv_rows is None and k.shape[0] != B):
        raise ValueError(f"k must be [B={B} (or pool rows with kv_rows), Hkv, S, D={D}], got {tuple(k.shape)}")
    if kv_rows is not None and (kv_rows.shape != (B,) or kv_rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"kv_rows must be int32/int64 of shape ({B},), got {kv_rows.dtype} {tuple(kv_rows.shape)}")
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hkv})")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    if n < 1:
        raise ValueError(f"need at least one query token, got n={n}")
    if prefix_len.shape != (B,) or prefix_len.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"prefix_len must be int32/int64 of shape ({B},), got {prefix_len.dtype} {tuple(prefix_len.shape)}"
        )
    if region_len < 1:
        raise ValueError(f"region_len must be >= 1, got {region_len}")
    width = packed_width(region_len)
    if mask_words.dtype != torch.int32 or mask_words.shape != (B, n, width):
        raise ValueError(
            f"mask words must be int32 of shape ({B}, {n}, {width}), got {mask_words.dtype} {tuple(mask_words.shape)}"
        )
    devices = {t.device for t in (q, k, v, prefix_len, mask_words) + ((kv_rows,) if kv_rows is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return Problem(B, H, Hkv, n, D, S, region_len)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernel assumes unit stride along head_dim (vectorised loads); other strides are free.
    return t if t.stride(-1) == 1 else t.contiguous()


def tree_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: torch.Tensor,
    region_mask: torch.Tensor,
    scale: float | None = None,
    *,
    kv_rows: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Drop-in for ``tree_attention_reference`` (same arguments, same result).

    q: [B, H, n, D]; k, v: [B, Hkv, S, D]; prefix_len: [B] int; region_mask: [B, n, R] bool.
    kv_rows: optional [B] int; then k, v are a KV pool [rows, Hkv, S, D] and sequence b reads
    row kv_rows[b] in place (same result as passing ``k[kv_rows]``, without that copy).
    CUDA tensors run the compiled kernel; CPU tensors need Triton's interpreter (module doc).
    """
    if region_mask.dtype != torch.bool or region_mask.dim() != 3:
        raise ValueError(
            f"region_mask must be a 3-D bool tensor [B, n, R], got {region_mask.dtype} {tuple(region_mask.shape)}"
        )
    return tree_attention_packed(
        q, k, v, prefix_len, pack_mask(region_mask), region_mask.shape[2], scale, kv_rows=kv_rows, config=config
    )


def tree_attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: torch.Tensor,
    mask_words: torch.Tensor,
    region_len: int,
    scale: float | None = None,
    *,
    kv_rows: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Tree attention with the region mask already packed (``pack_mask``: int32 [B, n, W]).

    Packing once per step and reusing the words in every layer saves the per-layer packing.
    Bits at or beyond ``region_len`` are ignored.
    """
    problem = _check_inputs(q, k, v, prefix_len, mask_words, region_len, kv_rows)
    interpret = interpreter_active()
    if not interpret and not q.is_cuda:
        raise ValueError(
            f"tensors are on {q.device}: the compiled kernel needs CUDA tensors, and CPU tensors need "
            "Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported)"
        )
    if config is None:
        sm_count = None if interpret else torch.cuda.get_device_properties(q.device).multi_processor_count
        config = default_config(problem, sm_count)
    if scale is None:
        scale = 1.0 / math.sqrt(problem.head_dim)

    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    mask_words = mask_words.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_d = max(16, triton.next_power_of_2(problem.head_dim))
    m_blocks = triton.cdiv(problem.rows, config.block_m)
    grid = (problem.batch * problem.num_kv_heads, m_blocks, config.num_splits)
    if config.num_splits > 1:
        parts = grid[0] * m_blocks * config.num_splits
        part_acc = torch.empty(parts * config.block_m * block_d, dtype=torch.float32, device=q.device)
        part_stats = torch.empty(parts * 2 * config.block_m, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_stats = None  # specialised away: the single launch writes Out directly
    # FMA contraction on, explicitly: Triton 3.9 warns when the default is relied on.
    launch = {} if interpret else dict(num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=True)
    widen = interpret and q.dtype == torch.bfloat16

    kernels = _kernels(interpret)
    kernels.fwd[grid](
        q, k, v, prefix_len, mask_words, kv_rows,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        mask_words.stride(0), mask_words.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        problem.num_queries, problem.num_kv_heads, problem.group_size, problem.num_slots,
        region_len, problem.head_dim,
        out, part_acc, part_stats,
        SCALE_LOG2=scale * LOG2E,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        NUM_SPLITS=config.num_splits,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 or widen else None,
        WIDEN_DOT=widen,
        **launch,
    )  # fmt: skip
    if config.num_splits > 1:
        kernels.combine[grid[:2]](
            part_acc, part_stats,
            out.stride(0), out.stride(1), out.stride(2),
            problem.num_queries, problem.num_kv_heads, problem.group_size, problem.head_dim,
            out,
            BLOCK_M=config.block_m,
            BLOCK_D=block_d,
            NUM_SPLITS=config.num_splits,
            **({} if interpret else dict(num_warps=config.num_warps, enable_fp_fusion=True)),
        )  # fmt: skip
    return out
