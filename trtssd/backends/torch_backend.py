"""TorchExecutor: the Executor protocol (trtssd/backends/base.py) on our torch Llama-family model.

Memory is planned once, at start-up: weights, a preallocated KV pool of ``max_seqs`` rows x
``max_seq_len`` slots, and scratch for the largest forward (``max_batch_tokens`` tokens of one
sequence). A request that does not fit raises ``CapacityError``; nothing is allocated per
sequence afterwards. Works on CPU (fp32 or bf16; linears packed for oneDNN) and on CUDA
(plain torch ops, the Triton tree-attention kernel; unverified: never run on a GPU). The KV pool
and scratch live on the model's device; logits come back to ``logits_device`` (the host by
default: the runtime's sampling, verification and Saguaro math runs there).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import psutil
import torch

from trtssd.backends.base import (CapacityError, Chunk, ExecutorCapabilities, PromptSplits, check_chunk, check_share,
                                  chunk_sequences, find_sequence)
from trtssd.models.config import ModelConfig
from trtssd.models.llama import AttentionBatch, Linear, LlamaModel
from trtssd.models.loader import load_model

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device now: CUDA's free bytes, or the OS's MemAvailable on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def kv_bytes(cfg: ModelConfig, dtype: torch.dtype, max_seqs: int, max_seq_len: int) -> int:
    """Bytes of the K and V pools for every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * max_seqs * cfg.num_kv_heads * max_seq_len * cfg.head_dim * itemsize


def scratch_bytes(
    cfg: ModelConfig, dtype: torch.dtype, tokens: int, seqs: int, queries: int, keys: int, logit_rows: int
) -> int:
    """Upper estimate of the transient memory of one forward: activations of ``tokens`` packed
    tokens, attention over [seqs, heads, queries, keys] (fp32 scores and probabilities, the mask,
    gathered and head-expanded K/V), and ``logit_rows`` rows of logits."""
    e = torch.empty((), dtype=dtype).element_size()
    hd = cfg.num_heads * cfg.head_dim
    activations = tokens * (4 * cfg.hidden_size + cfg.qkv_size + 2 * hd + 3 * cfg.intermediate_size) * e
    attention = seqs * cfg.num_heads * queries * keys * 9 + 4 * seqs * hd * keys * 4
    logits = logit_rows * cfg.vocab_size * (e + 4)
    return activations + attention + logits


def _module_weight_bytes(model: LlamaModel) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for module in model.modules():
        if isinstance(module, Linear) and module.packed:
            total += module._packed.numel() * module._packed.element_size()
    return total


@dataclass(frozen=True)
class MemoryPlan:
    """The start-up memory budget and how it is spent."""

    budget_bytes: int
    weight_bytes: int
    kv_bytes: int
    scratch_bytes: int  # reserved for one forward of max_batch_tokens tokens of one sequence

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.scratch_bytes

    def check(self) -> None:
        if self.total_bytes > self.budget_bytes:
            raise CapacityError(f"model does not fit the memory budget: {self}")

    def __str__(self) -> str:
        return (
            f"weights {_gib(self.weight_bytes)} + KV {_gib(self.kv_bytes)} + scratch {_gib(self.scratch_bytes)}"
            f" = {_gib(self.total_bytes)} of budget {_gib(self.budget_bytes)}"
        )


@dataclass
class _Sequence:
    row: int  # KV pool row
    committed: int = 0
    written: int = 0  # one past the highest slot written so far (commit may not pass it)


class TorchExecutor:
    """Runs a ``LlamaModel`` for the runtime: prefill, K+1 verification, glue and tree decode."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        max_seqs: int = 4,
        max_seq_len: int = 2048,
        max_batch_tokens: int | None = None,
        memory_budget_bytes: int | None = None,
        pack_linears: bool = True,
        plain_weights: bool = True,
        logits_device: str | torch.device = "cpu",
    ):
        """model: loaded, in its final dtype and device. max_seqs: KV pool rows (concurrent
        sequences). max_seq_len: slots per row (prompt + output + region). max_batch_tokens: most
        tokens in one forward (default max_seq_len). memory_budget_bytes: weights + KV + scratch
        limit (default: the weights plus the device's free memory now). pack_linears: add oneDNN
        layouts to ``Linear`` weights on CPU (faster multi-row steps; bf16 then drops the plain
        weights, so the model becomes inference-only). plain_weights: with pack_linears, keep the
        plain fp32 weights too (MKL's GEMV for single rows); False halves the linears' memory.
        logits_device: where ``forward`` returns logits. The host by default, because the
        runtime's per-row math (sampling with seeded CPU generators, verification, Saguaro) runs
        there: a CUDA model then pays one [rows, V] copy per forward, which also makes the
        forward's time measurable without a separate sync. Pass the model's device to keep them
        there (GPU tests, kernel timings)."""
        if model.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"model dtype must be one of {SUPPORTED_DTYPES}, got {model.dtype}")
        for name, value in (("max_seqs", max_seqs), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        max_batch_tokens = max_seq_len if max_batch_tokens is None else max_batch_tokens
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}")
        if max_seq_len > model.config.max_position_embeddings:
            log.warning("max_seq_len %d exceeds the model's trained context %d",
                        max_seq_len, model.config.max_position_embeddings)
        self.model = model.eval()
        self.config: ModelConfig = model.config
        self.vocab_size = self.config.vocab_size
        self.max_seq_len = max_seq_len
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.device = model.device
        self.dtype = model.dtype
        self.logits_device = torch.device(logits_device)
        # Prompts split anywhere: a prefill split in two matches one forward to fp32 rounding
        # (measured up to 6e-5 in a logit on the default engine), as a verify row matches a plain step's.
        self.capabilities = ExecutorCapabilities(max_batch_tokens, PromptSplits(), shares_prefix=True)
        self.upkeep_s = 0.0  # no cache upkeep: the KV pool is preallocated rows
        if pack_linears:
            model.pack_linears(keep_plain=plain_weights)
        weights = _module_weight_bytes(model)
        self.memory = MemoryPlan(
            budget_bytes=memory_budget_bytes if memory_budget_bytes is not None
            else weights + available_memory_bytes(self.device),
            weight_bytes=weights,
            kv_bytes=kv_bytes(self.config, self.dtype, max_seqs, max_seq_len),
            scratch_bytes=self._scratch(max_batch_tokens, 1, max_batch_tokens, max_seq_len, max_batch_tokens),
        )
        self.memory.check()
        shape = (max_seqs, self.config.num_kv_heads, max_seq_len, self.config.head_dim)
        self._kv = [
            tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
            for _ in range(self.config.num_layers)
        ]
        self._free_rows = list(range(max_seqs))
        self._seqs: dict[int, _Sequence] = {}
        log.info("TorchExecutor %s %s on %s: %s", self.config.arch, self.dtype, self.device, self.memory)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_seqs: int = 4,
        max_seq_len: int = 2048,
        max_batch_tokens: int | None = None,
        memory_budget_bytes: int | None = None,
        plain_weights: bool = True,
        logits_device: str | torch.device = "cpu",
    ) -> "TorchExecutor":
        """Load a Hugging Face directory or a GGUF file (see trtssd.models.loader). The KV pool
        and scratch are checked against the budget before the weights are read. plain_weights:
        see ``__init__``. device: where the weights are loaded to (each tensor straight from the
        file to the device) and where the KV pool is allocated."""
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        device = torch.device(device)

        def check_fixed_memory(cfg: ModelConfig) -> None:
            if memory_budget_bytes is None:
                return
            fixed = kv_bytes(cfg, dtype, max_seqs, max_seq_len) + cls._scratch_for(
                cfg, dtype, max_batch_tokens or max_seq_len, max_seq_len
            )
            if fixed > memory_budget_bytes:
                raise CapacityError(
                    f"KV pool and scratch alone ({_gib(fixed)}) exceed the memory budget {_gib(memory_budget_bytes)}"
                )

        model = load_model(path, dtype, before_weights=check_fixed_memory, device=device)
        return cls(
            model, max_seqs=max_seqs, max_seq_len=max_seq_len, max_batch_tokens=max_batch_tokens,
            memory_budget_bytes=memory_budget_bytes, plain_weights=plain_weights, logits_device=logits_device,
        )

    @staticmethod
    def _scratch_for(cfg: ModelConfig, dtype: torch.dtype, tokens: int, keys: int) -> int:
        return scratch_bytes(cfg, dtype, tokens, 1, tokens, keys, tokens)

    def _scratch(self, tokens: int, seqs: int, queries: int, keys: int, logit_rows: int) -> int:
        return scratch_bytes(self.config, self.dtype, tokens, seqs, queries, keys, logit_rows)

    def close(self) -> None:
        self._kv, self._free_rows = [], []
        self._seqs.clear()
        self.model = None

    # -- sequences ---------------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id} is already active")
        if not self._free_rows:
            raise CapacityError(f"all {self.max_seqs} KV rows are in use (max_seqs={self.max_seqs})")
        self._seqs[seq_id] = _Sequence(row=self._free_rows.pop(0))

    def release(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free_rows.append(seq.row)
            self._free_rows.sort()

    def committed(self, seq_id: int) -> int:
        return self._seq(seq_id).committed

    def commit(self, seq_id: int, n_tokens: int) -> None:
        seq = self._seq(seq_id)
        if not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
        if seq.committed + n_tokens > seq.written:
            raise ValueError(
                f"seq {seq_id}: cannot commit {n_tokens} tokens at {seq.committed}: "
                f"only slots < {seq.written} were written"
            )
        seq.committed += n_tokens

    def share_prefix(self, src_seq_id: int, dst_seq_id: int, n_tokens: int) -> None:
        """Copy the source's first ``n_tokens`` KV slots into the new sequence's row."""
        src, dst = self._seq(src_seq_id), self._seq(dst_seq_id)
        check_share(src_seq_id, src.committed, dst_seq_id, dst.written > 0, n_tokens)
        for pair in self._kv:
            for cache in pair:
                cache[dst.row, :, :n_tokens] = cache[src.row, :, :n_tokens]
        dst.committed = dst.written = n_tokens

    def spare_rows(self, tokens: int) -> int:
        return 0  # every row of a forward costs its compute here

    def copy_slots(self, seq_id: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        seq = self._seq(seq_id)
        src = torch.as_tensor(src).reshape(-1)
        dst = torch.as_tensor(dst).reshape(-1)
        if src.dtype.is_floating_point or dst.dtype.is_floating_point or src.numel() != dst.numel():
            raise ValueError(f"src and dst must be integer tensors of one length, got {src.dtype} "
                             f"[{src.numel()}] and {dst.dtype} [{dst.numel()}]")
        if src.numel() == 0:
            return
        lo, hi = seq.committed, seq.written
        if int(src.min()) < lo or int(src.max()) >= hi:
            raise ValueError(f"seq {seq_id}: src slots must lie in the written region [{lo}, {hi}), "
                             f"got [{int(src.min())}, {int(src.max())}]")
        if int(dst.min()) < lo or int(dst.max()) >= self.max_seq_len:
            raise ValueError(f"seq {seq_id}: dst slots must lie in [{lo}, {self.max_seq_len}), "
                             f"got [{int(dst.min())}, {int(dst.max())}]")
        if torch.unique(dst).numel() != dst.numel():
            raise ValueError(f"seq {seq_id}: dst slots must be distinct")
        src, dst = src.to(self.device, torch.long), dst.to(self.device, torch.long)
        for pair in self._kv:
            for cache in pair:
                row = cache[seq.row]  # [Hkv, S, D]
                row.index_copy_(1, dst, row.index_select(1, src))
        seq.written = max(seq.written, int(dst.max()) + 1)

    def _seq(self, seq_id: int) -> _Sequence:
        return find_sequence(self._seqs, seq_id)

    def cost_identity(self) -> dict[str, Any]:
        """The model's shape and how it runs: dtype, device, each projection's class and the
        tensors it holds (int4, int8, packed or plain weights: which kernel runs it), the compiled
        layers; and the sizes."""
        fused = self.model.fused_layers
        return {
            "executor": type(self).__name__,
            "accelerator": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
            "config": dataclasses.asdict(self.config),
            "dtype": str(self.dtype),
            "device": str(self.device),
            "max_seq_len": self.max_seq_len,
            "max_batch_tokens": self.max_batch_tokens,
            "projections": [[name, type(module).__name__, _held_tensors(module)] for name, module in self.model.linears()],
            "fused_layers": None if fused is None else [type(fused).__name__, fused.kind, fused.max_tokens],
        }

    # -- forward -----------------------------------------------------------------------------

    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        if not chunks:
            return []
        seqs = chunk_sequences(chunks, self._seqs)
        checked = [check_chunk(c, s.committed, self.max_seq_len, self.vocab_size) for c, s in zip(chunks, seqs)]
        lens = [n for n, _ in checked]
        total = sum(lens)
        if total > self.max_batch_tokens:
            raise CapacityError(f"forward of {total} tokens exceeds max_batch_tokens={self.max_batch_tokens}")
        logit_rows = sum(1 if c.last_logits_only else n for c, n in zip(chunks, lens))
        keys = max(s.committed + c.mask.shape[1] for c, s in zip(chunks, seqs))
        need = self._scratch(total, len(chunks), max(lens), keys, logit_rows)
        if need > self.memory.scratch_bytes:
            raise CapacityError(
                f"forward needs ~{_gib(need)} scratch, {_gib(self.memory.scratch_bytes)} reserved; split the batch"
            )

        dev = self.device
        batch = AttentionBatch.build(
            [s.row for s in seqs],
            [s.committed for s in seqs],
            [c.mask.to(dev) for c in chunks],
            torch.cat([c.positions for c in chunks]).to(dev, torch.long),
            torch.cat([c.slots for c in chunks]).to(dev, torch.long),
        )
        tokens = torch.cat([c.tokens for c in chunks]).to(dev, torch.long)
        with torch.inference_mode():
            hidden = self.model(tokens, batch, self._kv)
            if logit_rows < total:
                ends = torch.tensor(lens).cumsum(0)
                pick = [torch.arange(e - n, e) if not c.last_logits_only else (e - 1).view(1)
                        for c, n, e in zip(chunks, lens, ends)]
                hidden = hidden.index_select(0, torch.cat(pick).to(dev))
            logits = self.model.logits(hidden).float().to(self.logits_device)
        for seq, (_, end) in zip(seqs, checked):
            seq.written = max(seq.written, end)
        sizes = [1 if c.last_logits_only else n for c, n in zip(chunks, lens)]
        return list(logits.split(sizes))


def _held_tensors(module) -> list[str]:
    held = [n for n, v in module.named_parameters(recurse=False) if v is not None]
    held += [n for n, v in module.named_buffers(recurse=False) if v is not None]
    held += [n for n, v in vars(module).items() if isinstance(v, (torch.Tensor, torch.ScriptObject))
             or dataclasses.is_dataclass(v)]
    return sorted(set(held))
