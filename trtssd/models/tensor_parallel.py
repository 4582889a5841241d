"""Megatron-style tensor parallelism of ``LlamaModel``: the shard of the model rank r of T holds.

Each decoder layer needs two collectives and the head one:

* q/k/v and gate/up are split by output rows (column-parallel): rank r holds its ``H/T`` query
  heads, its ``Hkv/T`` key/value heads and its ``I/T`` slice of the MLP width. Attention and the
  SiLU gate are per head / per element, so they run on the local slice with no communication.
* o and down are split by input columns (row-parallel): each rank's product is a partial sum of
  the full output, and an all-reduce (sum) makes the full hidden state on every rank.
* The head is vocabulary-parallel: rank r projects onto its ``ceil(V/T)`` vocabulary rows and an
  all-gather gives every rank the full logits. The vocabulary is padded with zero rows to
  ``T * ceil(V/T)`` (any V works; the padded columns are cut off after the gather).
* Embeddings, RMSNorms (and Qwen3's per-head q/k norms) are replicated: the lookup and the norms
  are cheap, and a replicated table needs no collective (a vocab-parallel lookup would add one
  all-reduce per forward for memory we do not need to save yet).

The shard is an ordinary ``LlamaModel`` built from a *local* ``ModelConfig`` (heads, KV heads and
MLP width divided by T), so the decoder code, RoPE, tree attention and the executor's KV pool
(sized from the local config: each rank caches only its own KV heads) are the same code as T=1.
Only three projections differ, made by the linear factory: ``RowParallelLinear`` (o, down) and
``VocabParallelHead`` (lm_head), both ``Linear`` plus one collective.

Every rank must run the same forwards in the same order (the collectives pair up by order).
Results equal the T=1 model up to floating-point summation order (the all-reduce adds T partial
sums instead of one long dot product), i.e. not bit for bit; ``tests/test_tensor_parallel.py``
measures the difference.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping

import torch
import torch.distributed as dist

from trtssd.models.config import ModelConfig
from trtssd.models.llama import Linear, LlamaModel

log = logging.getLogger(__name__)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Refuse a ``tensor_parallel_size`` that does not split the model evenly.

    Query heads, KV heads and the MLP width must each divide by ``size`` (KV heads are split, not
    replicated, so ``size`` may not exceed ``num_kv_heads``). The vocabulary need not: it is padded.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    allowed = [t for t in range(1, cfg.num_kv_heads + 1)
               if cfg.num_heads % t == 0 and cfg.num_kv_heads % t == 0 and cfg.intermediate_size % t == 0]
    if size not in allowed:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide this model (num_attention_heads={cfg.num_heads}, "
            f"num_key_value_heads={cfg.num_kv_heads}, intermediate_size={cfg.intermediate_size}); "
            f"allowed values: {', '.join(map(str, allowed))}"
        )


def local_vocab_size(cfg: ModelConfig, size: int) -> int:
    """Vocabulary rows of one rank's head: ceil(V / T) (the last rank's tail is zero padding)."""
    return -(-cfg.vocab_size // size)


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The configuration one rank's ``LlamaModel`` is built from: its heads, KV heads and MLP width.

    ``vocab_size`` stays the full vocabulary (the replicated embedding, and what token ids are
    checked against); the head's local width comes from ``local_vocab_size``. For T > 1 embeddings
    are never tied in a shard: its head holds its own slice of the (tied or untied) head matrix.
    """
    check_tensor_parallel(cfg, size)
    if size == 1:  # the whole model, tied or not
        return cfg
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
        tie_word_embeddings=False,
    )


def shard_state_dict(
    cfg: ModelConfig, state: Mapping[str, torch.Tensor], rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Slice a full state dict (``LlamaModel``'s layout, as ``load_state_dict`` yields it) for
    ``rank`` of ``size``.

    Every slice is copied (``clone``) so the full tensors can be freed once all shards are made:
    a view would keep the whole checkpoint alive in every rank.
    """
    check_tensor_parallel(cfg, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    if size == 1:  # the whole model as loaded: no copy (so T=1 is the plain model bit for bit)
        return dict(state)
    D = cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D  # rows of q and of each of k, v in the fused qkv
    q_local, kv_local, i_local = q // size, kv // size, cfg.intermediate_size // size

    def rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
        return t[start : start + n]

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:
        # The fused rows are [q | k | v]; this rank takes its heads from each part.
        return torch.cat((rows(t, rank * q_local, q_local),
                          rows(t, q + rank * kv_local, kv_local),
                          rows(t, q + kv + rank * kv_local, kv_local)))

    def gate_up_rows(t: torch.Tensor) -> torch.Tensor:
        # The fused rows are [gate | up]; SiLU(gate) * up pairs element i of each, so take both.
        I = cfg.intermediate_size
        return torch.cat((rows(t, rank * i_local, i_local), rows(t, I + rank * i_local, i_local)))

    def head_rows(t: torch.Tensor) -> torch.Tensor:
        v_local = local_vocab_size(cfg, size)
        out = torch.zeros(v_local, t.shape[1], dtype=t.dtype, device=t.device)  # padding rows stay 0
        part = rows(t, rank * v_local, v_local)
        out[: part.shape[0]] = part
        return out

    shard: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            t = qkv_rows(t)
        elif name.endswith("mlp.gate_up.weight"):
            t = gate_up_rows(t)
        elif name.endswith("attn.o.weight"):
            t = t[:, rank * q_local : (rank + 1) * q_local]
        elif name.endswith("mlp.down.weight"):
            t = t[:, rank * i_local : (rank + 1) * i_local]
        elif name.endswith("attn.o.bias"):
            # Row-parallel outputs are summed over ranks: the bias must enter the sum once.
            t = t if rank == 0 else torch.zeros_like(t)
        elif name == "lm_head.weight":
            t = head_rows(t)
        # everything else (embedding, norms) is replicated
        shard[name] = t.clone()
    if cfg.tie_word_embeddings:  # the shard's head is untied: give it its slice of the embedding
        shard["lm_head.weight"] = head_rows(state["embed.weight"])
    return shard


class RowParallelLinear(Linear):
    """A ``Linear`` over this rank's input columns whose partial outputs are summed over ranks.

    The bias (o_proj's, when there is one) is held by rank 0 only, zeros elsewhere
    (``shard_state_dict``), so the plain and oneDNN-packed paths of ``Linear`` both add it once.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group: dist.ProcessGroup | None):
        super().__init__(in_features, out_features, bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y


class VocabParallelHead(Linear):
    """The vocabulary projection over this rank's ``ceil(V/T)`` rows, gathered to full [N, V] on
    every rank (every rank returns the same logits, so any rank can sample)."""

    def __init__(self, in_features: int, vocab_size: int, size: int, group: dist.ProcessGroup | None):
        super().__init__(in_features, -(-vocab_size // size), False)
        self.vocab_size, self.size, self.group = vocab_size, size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        # Rank r's rows are vocabulary ids [r * V/T, (r+1) * V/T); drop the padding at the end.
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def tensor_parallel_model(
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    rank: int,
    size: int,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LlamaModel:
    """Rank ``rank``'s shard of the model with config ``cfg`` and full weights ``state``: a
    ``LlamaModel`` of ``shard_config(cfg, size)`` whose o, down and lm_head projections
    communicate over ``group`` (the default process group when None, which must then have
    ``size`` ranks). Ready for ``TorchExecutor``: eval, no grad, in ``dtype`` on ``device``."""
    check_tensor_parallel(cfg, size)
    if group is not None or dist.is_initialized():
        world = dist.get_world_size(group)
        if world != size:
            raise ValueError(f"tensor_parallel_size={size} but the process group has {world} ranks")
    elif size > 1:
        raise ValueError("tensor_parallel_size > 1 needs an initialized torch.distributed process group")
    local = shard_config(cfg, size)

    def make_linear(name: str, in_features: int, out_features: int, bias: bool) -> torch.nn.Module:
        if size == 1:  # nothing to communicate: exactly the plain model
            return Linear(in_features, out_features, bias)
        if name.endswith(".attn.o") or name.endswith(".mlp.down"):
            return RowParallelLinear(in_features, out_features, bias, group)
        if name == "lm_head":
            return VocabParallelHead(in_features, local.vocab_size, size, group)
        return Linear(in_features, out_features, bias)

    with torch.device(device):
        model = LlamaModel(local, make_linear)
    model.load_weights(shard_state_dict(cfg, state, rank, size))
    log.info("tensor-parallel shard %d/%d: %d heads, %d KV heads, MLP %d, head rows %d",
             rank, size, local.num_heads, local.num_kv_heads, local.intermediate_size, local_vocab_size(cfg, size))
    return model.to(dtype).eval()
