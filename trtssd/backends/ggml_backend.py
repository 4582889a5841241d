"""GgmlExecutor: the Executor protocol (trtssd/backends/base.py) on llama.cpp, through
llama-cpp-python's low-level API.

The GGUF file runs as it is (mmap, llama.cpp's own kernels): no dequantizing, nothing rebuilt at
load. llama.cpp owns its KV cache, so the protocol's storage slots and region masks are realised
with its *sequence ids*: a token attends to the cells that carry the sequence id it is written
with (causally, by position), and a cell may carry several ids. We call a sequence id a **lane**.

- A trtssd sequence has a *base* lane that holds its committed prefix, and more lanes while its
  region holds a tree: a tree branch is a lane that shares the prefix and the glue tokens it
  continues (``llama_memory_seq_cp`` adds ids to cells, copying nothing) and holds its own
  tree tokens.
- Each written token becomes a *cell*. Every token of a forward is written on the lane whose
  cells are exactly what its mask lets it see; when no lane holds that set, a new lane is made
  from the base lane's prefix plus the visible cells. So any tree-shaped mask works, and a
  token never sees what its mask hides.
- ``copy_slots`` makes slots name the same cells (no KV is copied, no token is decoded again);
  ``commit`` makes the base lane hold the committed cells; a cell no slot names any more is
  removed from every lane (llama.cpp then frees it).

Exactness needs a row's logits to be the same alone, inside a verify chain, inside a batch of
other sequences, after other requests came and went, and on either thread count. llama.cpp's CPU
kernels give that only under conditions this executor keeps (``row_invariant``, the target's
setting; tests/test_ggml_backend.py checks each, so an upgrade that breaks one fails loudly):

- Flash attention on (off, rows differ by up to 0.65) and no weight repacking (its kernels differ
  between one row and several).
- Flash attention sums a row's keys in cache-cell order, so every token's visible cells must lie
  in position order: a freed cell is never reused in place (it moves to a *trash* lane nobody
  attends to), and when the trash grows the cache is compacted: the live cells are copied out,
  group by group of the lanes that hold them, and laid back from cell 0, each lane's in their
  order (a token sees only its lane's cells, so the order across lanes is free). When the last
  live sequence leaves, every cell is freed at once.
- A forward of 64 tokens or more runs a tiled attention whose sums group keys by 64-cell tiles:
  such a chain (a prompt) starts at a cell whose index is its position modulo 64 (a few *filler*
  tokens, trashed at once, pad the cache up to it) and is cut at fixed positions (multiples of
  512). The prefix such a chain continues (a chunked prompt's earlier pieces, a cached prefix)
  must lie so too, and a compaction moves cells by whatever was trashed before them: a sequence
  whose prefix a compaction moved is *realigned* before its next long chain (its prefix copied
  out and laid back from an aligned cell, as a cached prefix is loaded).
- Every other forward stays below 64 tokens, on the one-row attention kernel. Its matmuls keep a
  row's sums whatever the batch, except llama.cpp's tiled matmul (ggml-cpu/tiled), which takes
  K-quant and IQ weights (Q4_K_M files, and the Q6_K output matrix many quantized files carry) in
  forwards of 8 rows or more: its sums differ from the one-row kernel's by up to 0.5 in a logit
  (measured on the Qwen2.5-Coder 1.5B Q4_K_M target). So a file with such weights decodes in
  pieces of at most 7 tokens (unless that matmul is off, ``GGML_CPU_TILED_MM=0``), any other in
  pieces of up to 63: every running sequence's rows in one forward
  (docs/bench/ggml-exact-rows-full-batch measures both). On such a file a prompt of 8 tokens or
  more (a chunk asking for its last logits only) is decoded with other such prompts only, on the
  tiled matmul: every mode and batch prefills it so, and its rows are never compared with decoded
  ones.
- A one-token forward on two or more threads splits a long cache (past 256 cells, where the
  attention's key view reaches 512) across the threads, and its sums change: the pieces above
  never hold a single token, and a forward of one token over a long cache (a plain round of one
  row that borrows the draft's cores, trtssd.runtime.core_lending.CoreLending) gets a filler token
  beside it, unless ``set_threads(n, split_single_rows=True)`` asks for llama.cpp's own
  multi-thread decoding, faster and no longer bit-identical to the rows of a verify chain.
  ``spare_rows`` tells the loop where the filler would go: a plain round outside ar mode puts a
  guess at the next token there instead (trtssd/runtime/target_loop.py, ``TargetLoop._spare_row_guess``). Where
  only trashed cells make the cache that long (requests came and went), it is compacted instead:
  a copy of the few live cells once, against a whole extra row on every token.

The draft (``row_invariant=False``) frees cells in place: its rows need not be exact (a proposal's
distribution is whatever it was sampled from), and its tree steps free many cells each round.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import gguf
import numpy as np
import torch

from trtssd.backends.base import (CapacityError, Chunk, ExecutorCapabilities, PromptSplits, check_chunk, check_share,
                                  chunk_sequences, find_sequence)

log = logging.getLogger(__name__)

MAX_LANES = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids per context
_FLASH_ATTN_ENABLED = 1  # llama_flash_attn_type: LLAMA_FLASH_ATTN_TYPE_ENABLED
_MIN_CELLS = 1024
_UBATCH = 512  # tokens per llama.cpp micro-batch (its compute buffer is sized for it)
_TILE = 64  # llama.cpp's CPU flash attention tiles forwards of this many tokens and more
_SHORT_PIECE = 7  # the most tokens of a forward below llama.cpp's tiled K-quant matmul (ggml-cpu/tiled: 8)
_WIDE_PIECE = _TILE - 1  # the most tokens of a forward on one-row kernels when that matmul takes no weight
# Weight types llama.cpp's tiled matmul takes (ggml-cpu/tiled/tiled.cpp's type switch).
_TILED_TYPES = frozenset(gguf.GGMLQuantizationType[name].value for name in (
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "IQ4_XS"))
_PROMPT_CUT = 512  # a long chain is cut at positions that are multiples of this
_COMPACT_AFTER = 256  # trashed cells that trigger a compaction
_SPLIT_AFTER = 256  # with more cells than this, llama.cpp splits a one-token forward's keys across threads

_init_lock = threading.Lock()
_initialized = False
_log_callback = None  # kept referenced: llama.cpp calls it from C
_quiet = [None]  # a load-progress callback that prints nothing (the default prints dots to stderr)


def llama_library():
    """llama_cpp, initialised once per process with its log routed to ``logging``. Code that
    calls llama.cpp directly in this process starts here too: llama.cpp keeps one log callback per
    process, and one set elsewhere and then freed crashes the next model load."""
    global _initialized, _log_callback
    import llama_cpp

    with _init_lock:
        if not _initialized:
            llama_cpp.llama_backend_init()
            ggml_log = logging.getLogger("llama.cpp")

            def forward_log(level: int, text: bytes, _user) -> None:
                if level >= 4:  # GGML_LOG_LEVEL_ERROR
                    ggml_log.error(text.decode(errors="replace").rstrip())
                else:
                    ggml_log.debug(text.decode(errors="replace").rstrip())

            _log_callback = llama_cpp.llama_log_callback(forward_log)
            _quiet[0] = llama_cpp.llama_progress_callback(lambda _progress, _user: True)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            _initialized = True
    return llama_cpp


def weight_types(path: str | Path) -> set[int]:
    """The ggml types of a GGUF file's tensors, read by ggml's own GGUF parser (headers only)."""
    from llama_cpp._ggml import libggml

    class _InitParams(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    libggml.gguf_init_from_file.restype = ctypes.c_void_p
    libggml.gguf_init_from_file.argtypes = [ctypes.c_char_p, _InitParams]
    libggml.gguf_get_n_tensors.restype = ctypes.c_int64
    libggml.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    libggml.gguf_get_tensor_type.restype = ctypes.c_int
    libggml.gguf_get_tensor_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    libggml.gguf_free.argtypes = [ctypes.c_void_p]
    handle = libggml.gguf_init_from_file(str(path).encode(), _InitParams(True, None))
    if not handle:
        raise ValueError(f"not a GGUF file ggml can read: {path}")
    try:
        return {libggml.gguf_get_tensor_type(handle, i) for i in range(libggml.gguf_get_n_tensors(handle))}
    finally:
        libggml.gguf_free(handle)


def widest_exact_piece(path: str | Path) -> int:
    """The most tokens of a forward whose rows keep their one-row sums on this file (module
    docstring): 7 where llama.cpp's tiled matmul takes some of its weights, 63 elsewhere."""
    if os.environ.get("GGML_CPU_TILED_MM", "1").strip() == "0":
        return _WIDE_PIECE
    return _SHORT_PIECE if weight_types(path) & _TILED_TYPES else _WIDE_PIECE


@dataclass(eq=False)
class _Cell:
    """One written token's KV in llama.cpp's cache."""

    pos: int
    lanes: set[int] = field(default_factory=set)  # lane ids whose copy of the cache holds it
    refs: int = 0  # slots that name it


@dataclass(frozen=True)
class SavedPrefix:
    """A prompt's KV copied out of llama.cpp's cache (``save_prefix``), as llama.cpp serialises
    one sequence's state."""

    n_tokens: int
    data: ctypes.Array  # llama_state_seq_get_data's bytes
    size: int


@dataclass(eq=False)
class _Lane:
    """One llama.cpp sequence id: the first ``prefix`` committed cells of its sequence, and
    ``region`` (position -> cell) past them."""

    id: int
    prefix: int = 0
    region: dict[int, _Cell] = field(default_factory=dict)


@dataclass(eq=False)
class _Sequence:
    base: _Lane
    committed: int = 0
    prefix: list[_Cell] = field(default_factory=list)  # committed cells, by position
    slots: dict[int, _Cell] = field(default_factory=dict)  # region slot -> cell
    lanes: list[_Lane] = field(default_factory=list)  # base first
    laid: int = 0  # the executor's compaction count when its prefix was last known aligned


class GgmlExecutor:
    """Runs a GGUF model on llama.cpp for the runtime: prefill, K+1 verification, glue and tree."""

    def __init__(self, path: str | Path, *, max_seqs: int = 4, max_seq_len: int = 2048,
                 max_batch_tokens: int | None = None, threads: int | None = None, row_invariant: bool = True):
        """path: a GGUF file. max_seqs: concurrent sequences. max_seq_len: slots per sequence
        (prompt + output + region); the cache holds max_seqs x max_seq_len cells (row_invariant:
        and half as many again for trashed cells). max_batch_tokens:
        most tokens in one forward (default max_seq_len). threads: llama.cpp threads (default:
        torch's thread count, which the rank's pinning sets). row_invariant: keep a row's logits
        independent of its batch and of the cache's history (the module docstring says how)."""
        for name, value in (("max_seqs", max_seqs), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        max_batch_tokens = max_seq_len if max_batch_tokens is None else max_batch_tokens
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self._L = L = llama_library()
        self.max_seqs, self.max_seq_len, self.max_batch_tokens = max_seqs, max_seq_len, max_batch_tokens
        self.threads = threads or torch.get_num_threads()
        self.split_single_rows = False
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = False  # no repacking: its kernels make a row depend on its batch
        mparams.progress_callback = _quiet[0]
        self._model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path}")
        self.vocab_size = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model))
        trained = L.llama_model_n_ctx_train(self._model)
        if max_seq_len > trained:
            log.warning("max_seq_len %d exceeds the model's trained context %d", max_seq_len, trained)
        cparams = L.llama_context_default_params()
        cells = max_seqs * max_seq_len
        if row_invariant:
            # Room for the trash besides max_seqs full sequences, and for the filler and alignment
            # tokens. A compaction copies every live cell: with trash room of half the sequences'
            # cells, one over a full cache copies at most two cells per cell it frees.
            cells += cells // 2 + _COMPACT_AFTER + _UBATCH + _TILE
        # At least _MIN_CELLS: llama.cpp 0.3.36 crashed making a context of 256 cells with 256 sequence ids.
        cparams.n_ctx = max(cells, _MIN_CELLS)
        # llama.cpp 0.3.36 crashed making contexts whose micro-batch was smaller than its sequence ids.
        cparams.n_batch = max(max_batch_tokens, _UBATCH)
        cparams.n_ubatch = _UBATCH
        cparams.n_seq_max = MAX_LANES
        cparams.kv_unified = True  # one cell pool: lanes share cells instead of copying them
        cparams.flash_attn_type = _FLASH_ATTN_ENABLED
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        self._ctx = L.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            L.llama_model_free(self._model)
            raise CapacityError(f"llama.cpp could not make a context of {cparams.n_ctx} cells for {self.path}")
        self._memory = L.llama_get_memory(self._ctx)
        self._batch = L.llama_batch_init(cparams.n_batch, 0, 1)
        self.row_invariant = row_invariant
        self.piece = widest_exact_piece(self.path) if row_invariant else None
        self.prompt_splits = TiledPromptSplits(self.piece) if row_invariant else PromptSplits()
        self.capabilities = ExecutorCapabilities(max_batch_tokens, self.prompt_splits, shares_prefix=True,
                                                 saves_prefix=True, lends_threads=True)
        self._n_cells = cparams.n_ctx
        # Two lanes nobody attends to: the trash holds freed cells until a compaction, the filler
        # the tokens that pad the cache up to a prompt's aligned cell.
        self._trash, self._filler = MAX_LANES - 1, MAX_LANES - 2
        self._free_lanes = list(range(MAX_LANES - 2 if row_invariant else MAX_LANES))
        self._allocated = 0  # cells llama.cpp holds (row_invariant: live + trash, packed from cell 0)
        self._trashed = 0
        self._compactions = 0
        # Seconds spent compacting so far: upkeep for every round since the last compaction, paid
        # within one forward. Load control leaves it out of the rounds it times (Executor.upkeep_s).
        self.upkeep_s = 0.0
        self._seqs: dict[int, _Sequence] = {}
        log.info("GgmlExecutor %s: %d threads, %d cells, vocab %d", self.path.name, self.threads,
                 cparams.n_ctx, self.vocab_size)

    def close(self) -> None:
        """Free llama.cpp's context and model (also done at garbage collection)."""
        if getattr(self, "_ctx", None):
            self._L.llama_batch_free(self._batch)
            self._L.llama_free(self._ctx)
            self._L.llama_model_free(self._model)
            self._ctx = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def cost_identity(self) -> dict[str, Any]:
        """The GGUF file (its weights' types run llama.cpp's kernels for them) and the sizes."""
        stat = self.path.stat()
        return {"executor": type(self).__name__, "model": str(self.path.resolve()), "bytes": stat.st_size,
                "row_invariant": self.row_invariant, "max_seq_len": self.max_seq_len,
                "max_batch_tokens": self.max_batch_tokens}

    def set_threads(self, threads: int, split_single_rows: bool = False) -> None:
        """Threads for the next forwards (plain rounds borrow the draft's cores). A one-token
        forward over a long cache (llama.cpp splits it across threads there) gets a filler token
        beside it unless ``split_single_rows``: then it runs as llama.cpp's own multi-thread
        decoding, faster, and its logits may differ from a multi-token forward's in the last bits."""
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        self.threads = threads
        self.split_single_rows = split_single_rows
        self._L.llama_set_n_threads(self._ctx, threads, threads)

    # -- sequences ---------------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id} is already active")
        if len(self._seqs) >= self.max_seqs:
            raise CapacityError(f"all {self.max_seqs} sequences are in use (max_seqs={self.max_seqs})")
        base = self._new_lane()
        self._seqs[seq_id] = _Sequence(base=base, lanes=[base], laid=self._compactions)

    def release(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            for lane in seq.lanes:
                self._free_lane(lane)
        if self.row_invariant and self._trashed and not any(s.committed or s.slots for s in self._seqs.values()):
            self._empty()

    def _empty(self) -> None:
        """Free every cell once no sequence holds one (the cache holds only trash): the next
        token is laid from cell 0 as after a compaction, at no cost, where a compaction would
        copy the live cells and clear llama.cpp's whole cache buffer (its cost grows with the
        cache's size, not with what it holds)."""
        self._L.llama_memory_clear(self._memory, False)
        self._allocated, self._trashed = 0, 0
        self._compactions += 1

    def committed(self, seq_id: int) -> int:
        return self._seq(seq_id).committed

    def commit(self, seq_id: int, n_tokens: int) -> None:
        seq = self._seq(seq_id)
        if not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
        for slot in range(seq.committed, seq.committed + n_tokens):
            cell = seq.slots.get(slot)
            if cell is None:
                raise ValueError(f"seq {seq_id}: cannot commit {n_tokens} tokens at {seq.committed}: "
                                 f"slot {slot} was not written")
            if cell.pos != slot:
                raise ValueError(f"seq {seq_id}: slot {slot} holds position {cell.pos}; committed "
                                 "tokens must sit at their own positions")
        for slot in range(seq.committed, seq.committed + n_tokens):
            cell = seq.slots.pop(slot)
            self._hold(seq.base, cell)
            seq.prefix.append(cell)
        seq.committed += n_tokens
        self._settle_lanes(seq)

    def share_prefix(self, src_seq_id: int, dst_seq_id: int, n_tokens: int) -> None:
        """The new sequence's base lane holds the source's first committed cells too (llama.cpp
        adds a sequence id to those cells): nothing is copied or recomputed."""
        src, dst = self._seq(src_seq_id), self._seq(dst_seq_id)
        check_share(src_seq_id, src.committed, dst_seq_id, bool(dst.committed or dst.slots), n_tokens)
        self._L.llama_memory_seq_cp(self._memory, src.base.id, dst.base.id, 0, n_tokens)
        dst.prefix = src.prefix[:n_tokens]
        for cell in dst.prefix:
            cell.lanes.add(dst.base.id)
        dst.committed = dst.base.prefix = n_tokens
        dst.laid = src.laid

    def save_prefix(self, seq_id: int, n_tokens: int) -> SavedPrefix:
        """A copy of the first ``n_tokens`` committed tokens' KV in host memory (llama.cpp's
        per-sequence state), so a finished prompt kept for reuse leaves the cache: every forward
        attends over all of llama.cpp's cells, so kept cells would slow every later token."""
        seq = self._seq(seq_id)
        check_share(seq_id, seq.committed, seq_id, False, n_tokens)
        return self._save(seq, n_tokens)

    def _save(self, seq: _Sequence, n_tokens: int) -> SavedPrefix:
        L, lane = self._L, self._new_lane()  # a lane holding exactly those cells, for the copy
        try:
            L.llama_memory_seq_cp(self._memory, seq.base.id, lane.id, 0, n_tokens)
            data = (ctypes.c_ubyte * L.llama_state_seq_get_size(self._ctx, lane.id))()
            written = L.llama_state_seq_get_data(self._ctx, data, len(data), lane.id)
        finally:
            L.llama_memory_seq_rm(self._memory, lane.id, -1, -1)  # the cells stay on the base lane
            self._free_lanes.append(lane.id)
        if not written:
            raise RuntimeError("llama.cpp could not copy a prefix out of its cache")
        return SavedPrefix(n_tokens, data, written)

    def load_prefix(self, seq_id: int, saved: SavedPrefix, n_tokens: int) -> None:
        """Give the new sequence the first ``n_tokens`` of a saved prefix as its committed prefix:
        the same KV bytes, laid out from a cell aligned as a prefill's would be."""
        seq = self._seq(seq_id)
        check_share(seq_id, saved.n_tokens, seq_id, bool(seq.committed or seq.slots), n_tokens)
        if self.row_invariant and self._allocated + saved.n_tokens + _TILE > self._n_cells:
            self.compact()
        self._lay_prefix(seq, saved, n_tokens)

    def _lay_prefix(self, seq: _Sequence, saved: SavedPrefix, n_tokens: int) -> None:
        L, lane = self._L, seq.base.id
        if self.row_invariant and n_tokens >= _TILE:  # a long prompt's prefix: its tiles align
            self._align(0)
        if L.llama_state_seq_set_data(self._ctx, saved.data, saved.size, lane) != saved.size:
            raise CapacityError(f"llama.cpp found no room for a {saved.n_tokens}-token prefix")
        self._allocated += saved.n_tokens
        if n_tokens < saved.n_tokens:  # the rest of the saved prompt: not this request's prefix
            self._trash_cells(lane, n_tokens, saved.n_tokens)
            L.llama_memory_seq_rm(self._memory, lane, n_tokens, -1)
        seq.prefix = [_Cell(pos, {lane}) for pos in range(n_tokens)]
        seq.committed = seq.base.prefix = n_tokens
        seq.laid = self._compactions

    def _realign(self, seq: _Sequence) -> None:
        """Lay a sequence's committed prefix again from an aligned cell (module docstring): its
        cells go to the trash (those other sequences share stay theirs) and a copy comes back."""
        saved = self._save(seq, seq.committed)
        self._trash_cells(seq.base.id, 0, seq.committed)
        self._L.llama_memory_seq_rm(self._memory, seq.base.id, -1, -1)
        for cell in seq.prefix:
            cell.lanes.discard(seq.base.id)
        self._lay_prefix(seq, saved, seq.committed)

    def copy_slots(self, seq_id: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots ``dst`` name the cells of slots ``src``: the same KV, nothing recomputed."""
        seq = self._seq(seq_id)
        src = torch.as_tensor(src).reshape(-1).tolist()
        dst = torch.as_tensor(dst).reshape(-1).tolist()
        if len(src) != len(dst):
            raise ValueError(f"src and dst must have one length, got {len(src)} and {len(dst)}")
        if len(set(dst)) != len(dst):
            raise ValueError(f"seq {seq_id}: dst slots must be distinct")
        missing = [s for s in src if s not in seq.slots]
        if missing:
            raise ValueError(f"seq {seq_id}: src slots {missing} are not written region slots")
        if any(d < seq.committed or d >= self.max_seq_len for d in dst):
            raise ValueError(f"seq {seq_id}: dst slots must lie in [{seq.committed}, {self.max_seq_len})")
        cells = [seq.slots[s] for s in src]  # gathered before any is overwritten
        for cell in cells:
            cell.refs += 1
        for d in dst:
            self._drop_slot(seq, d)
        for d, cell in zip(dst, cells):
            seq.slots[d] = cell
        self._settle_lanes(seq)

    def _seq(self, seq_id: int) -> _Sequence:
        return find_sequence(self._seqs, seq_id)

    # -- forward -----------------------------------------------------------------------------

    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        if not chunks:
            return []
        seqs = chunk_sequences(chunks, self._seqs)
        for c, seq in zip(chunks, seqs):
            check_chunk(c, seq.committed, self.max_seq_len, self.vocab_size)
        total = sum(c.tokens.numel() for c in chunks)
        if total > self.max_batch_tokens:
            raise CapacityError(f"forward of {total} tokens exceeds max_batch_tokens={self.max_batch_tokens}")
        for c, seq in zip(chunks, seqs):  # what the chunks overwrite is gone before lanes are chosen
            for slot in c.slots.tolist():
                self._drop_slot(seq, slot)
            self._settle_lanes(seq)
        # A compaction copies every live cell (0.34 s for 8,000 on SmolLM2), so it waits for at least
        # as many trashed ones: its cost per freed cell stays the same however many prompts the
        # prefix cache keeps live.
        compact_after = max(_COMPACT_AFTER, self._allocated - self._trashed)
        moved = self._moved_prefixes(chunks, seqs)
        room = total + sum(seq.committed + _TILE for seq in moved)
        if self.row_invariant and (self._trashed >= compact_after or self._allocated + room + _TILE > self._n_cells
                                   or self._trash_splits(total)):
            self.compact()  # before placing: the cells placed below are not in llama.cpp's cache yet
        for seq in self._moved_prefixes(chunks, seqs):
            self._realign(seq)
        per_chunk = []  # each chunk's (token, position, lane id, wants logits)
        for c, seq in zip(chunks, seqs):
            lanes = self._place(c, seq)
            n = c.tokens.numel()
            wants = [not c.last_logits_only or i == n - 1 for i in range(n)]
            per_chunk.append(list(zip(c.tokens.tolist(), c.positions.tolist(), lanes, wants)))
        if not self.row_invariant:
            logits = self._decode([e for entries in per_chunk for e in entries])
        else:
            # Prompts, also those asking for every row's logits (prompt logprobs): their KV is then
            # the same as without, so what follows is too.
            prompts = [(c.last_logits_only or c.prompt) and c.tokens.numel() > self.piece for c in chunks]
            logits = self._decode_invariant(per_chunk, prompts)
        sizes = [1 if c.last_logits_only else c.tokens.numel() for c in chunks]
        return list(logits.split(sizes))

    def _moved_prefixes(self, chunks: Sequence[Chunk], seqs: list[_Sequence]) -> list[_Sequence]:
        """Sequences whose long chain continues a prefix a compaction may have moved off its
        alignment. A prefix alone on its base lane only: a prefill's (a tree's region has
        only short forwards)."""
        if not self.row_invariant:
            return []
        for seq in seqs:
            if not seq.committed:
                seq.laid = self._compactions  # nothing laid yet: the chain aligns itself
        return [seq for c, seq in zip(chunks, seqs) if c.tokens.numel() >= _TILE and seq.laid != self._compactions
                and not seq.slots and len(seq.lanes) == 1]

    def _place(self, c: Chunk, seq: _Sequence) -> list[int]:
        """Write each token of the chunk on the lane holding exactly what its mask shows it;
        returns the lane ids, in token order."""
        positions = c.positions.tolist()
        slots = c.slots.tolist()
        mask = c.mask.cpu().numpy()
        chained = _chain_steps(mask, [s - seq.committed for s in slots], positions)
        lanes = []
        lane = None
        for i, (pos, slot) in enumerate(zip(positions, slots)):
            if not (i and chained[i - 1]):  # else: on the lane of the token before
                lane = self._lane_for(seq, self._visible(seq, mask[i], slot), pos)
            cell = _Cell(pos, {lane.id}, refs=1)
            lane.region[pos] = cell
            seq.slots[slot] = cell
            lanes.append(lane.id)
        return lanes

    def _visible(self, seq: _Sequence, mask_row: np.ndarray, own_slot: int) -> dict[int, _Cell]:
        """The region cells a token sees (position -> cell), its own slot excluded."""
        seen = {}
        for r in np.flatnonzero(mask_row).tolist():
            slot = seq.committed + r
            if slot == own_slot:
                continue
            cell = seq.slots.get(slot)
            if cell is None:
                raise ValueError(f"a token's mask shows slot {slot}, which holds no token")
            if cell.pos in seen or cell.pos < seq.committed:
                raise ValueError(f"a token's mask shows two tokens at position {cell.pos} (or one inside "
                                 "the committed prefix): not a tree, which llama.cpp's lanes cannot express")
            seen[cell.pos] = cell
        return seen

    def _lane_for(self, seq: _Sequence, visible: dict[int, _Cell], pos: int) -> _Lane:
        """A lane whose cells are exactly the committed prefix and ``visible``, ready for a token
        at ``pos``: an existing one, or a new one made by sharing cells (no compute)."""
        if any(p >= pos for p in visible):
            raise ValueError(f"a token at position {pos} may only see earlier positions")
        if max(visible, default=seq.committed - 1) != pos - 1:
            raise ValueError(f"a token at position {pos} must continue the position before it")
        for lane in seq.lanes:
            if lane.prefix == seq.committed and _same_cells(lane.region, visible):
                return lane
        lane = self._new_lane()
        seq.lanes.append(lane)
        source = next((x for x in seq.lanes if x.prefix == seq.committed and x is not lane
                       and _same_cells({p: c for p, c in x.region.items() if p < pos}, visible)), None)
        if source is not None:  # the common case: a branch leaving a chain
            self._L.llama_memory_seq_cp(self._memory, source.id, lane.id, 0, pos)
            for cell in visible.values():
                cell.lanes.add(lane.id)
        else:
            self._L.llama_memory_seq_cp(self._memory, seq.base.id, lane.id, 0, seq.committed)
            for cell in visible.values():
                self._hold(lane, cell)
        lane.prefix = seq.committed
        lane.region = dict(visible)
        return lane

    def _decode_invariant(self, per_chunk: list[list[tuple[int, int, int, bool]]], prompts: list[bool]) -> torch.Tensor:
        """The forward as llama.cpp decodes it row-invariantly (module docstring): long chains
        alone, aligned and cut at fixed positions; prompts longer than a piece together, below 64
        tokens a forward; the rest in pieces of 2 to ``self.piece`` tokens. Logits rows come back
        in entry order."""
        entries = [e for chunk in per_chunk for e in chunk]
        chains: list[list[int]] = []  # entry indices decoded together from an aligned cell
        tiled_prompts, short, start = [], [], 0
        for chunk, prompt in zip(per_chunk, prompts):
            span = list(range(start, start + len(chunk)))
            if len(chunk) >= _TILE:
                chains += [span[a:b] for a, b in _chain_pieces(chunk[0][1], len(chunk))]
            elif prompt:
                tiled_prompts.append(span)
            else:
                short += span
            start += len(chunk)
        others = _packed(tiled_prompts, _TILE - 1) + [short[a:b] for a, b in _pieces(len(short), self.piece)]
        if not chains and len(others) == 1 and others[0] == list(range(len(entries))):
            return self._decode_padded(entries)  # one decode, rows in entry order already
        wanted = [i for i, e in enumerate(entries) if e[3]]
        row_of = {i: r for r, i in enumerate(wanted)}
        out = torch.empty(len(wanted), self.vocab_size)
        for n, indices in enumerate(chains + others):
            if n < len(chains):  # a piece continuing its chain's aligned cells stays aligned
                self._align(entries[indices[0]][1])
            rows = self._decode_padded([entries[i] for i in indices])
            out[[row_of[i] for i in indices if entries[i][3]]] = rows
        return out

    def _decode_padded(self, entries: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """One decode, with a filler token beside a lone token that llama.cpp would split across
        threads: two rows are not split."""
        padded = self._splits(len(entries), self._allocated)
        if not padded:
            return self._decode(entries)
        rows = self._decode(entries + [(0, 0, self._filler, False)])
        self._trash_filler(1)
        return rows

    def spare_rows(self, tokens: int) -> int:
        """1 where a forward of one token would carry a filler row (no compaction first), else 0."""
        padded = self.row_invariant and self._splits(tokens, self._allocated) and not self._trash_splits(tokens)
        return int(padded)

    def _splits(self, tokens: int, cells: int) -> bool:
        """Whether llama.cpp would split a forward of ``tokens`` across threads over a cache of
        ``cells`` cells before it (changing the row's sums), unless a filler row goes beside it."""
        return tokens == 1 and self.threads > 1 and not self.split_single_rows and cells + 1 > _SPLIT_AFTER

    def _trash_splits(self, total: int) -> bool:
        """Whether a one-token forward would need a filler row only because trashed cells push
        the cache past the split (a plain round after other requests came and went): compacting
        first costs a copy of the few live cells, a filler row a whole extra row per token."""
        return (self._trashed > 0 and self._splits(total, self._allocated)
                and not self._splits(total, self._allocated - self._trashed))

    def _align(self, position: int) -> None:
        """Pad the cache with filler tokens (trashed at once) until the next cell's index is
        ``position`` modulo 64: a long chain's tiles then group its keys by position alone."""
        n = (position - self._allocated) % _TILE
        if n:
            self._decode([(0, p, self._filler, False) for p in range(n)])
            self._trash_filler(n)

    def _trash_filler(self, n: int) -> None:
        self._L.llama_memory_seq_cp(self._memory, self._filler, self._trash, -1, -1)
        self._L.llama_memory_seq_rm(self._memory, self._filler, -1, -1)
        self._trashed += n

    def compact(self) -> None:
        """Drop the trash and lay the live cells again from cell 0, each lane's in their order
        (module docstring). Group by group where it can (`_relay`), else llama.cpp's whole state
        saved and restored, which lays cells out in the order they were saved but first clears
        llama.cpp's whole cache buffer, at a cost that grows with the cache's size."""
        L, t0 = self._L, time.perf_counter()
        L.llama_memory_seq_rm(self._memory, self._trash, -1, -1)
        groups = _restore_order(self._lane_cells())
        if groups is None or not self._free_lanes:
            self._restore_whole_state()
        else:
            self._relay(groups)
        self._allocated, self._trashed = self._live_cells(), 0
        self._compactions += 1
        self.upkeep_s += time.perf_counter() - t0

    def _restore_whole_state(self) -> None:
        L = self._L
        size = L.llama_state_get_size(self._ctx)
        buf = (ctypes.c_ubyte * size)()
        written = L.llama_state_get_data(self._ctx, buf, size)
        if L.llama_state_set_data(self._ctx, buf, written) != written:
            raise RuntimeError("llama.cpp could not restore its state while compacting the cache")

    def _lane_cells(self) -> dict[int, list[_Cell]]:
        """Every lane's live cells, by position: its share of its sequence's committed prefix, then
        its region."""
        return {lane.id: seq.prefix[:lane.prefix] + [lane.region[p] for p in sorted(lane.region)]
                for seq in self._seqs.values() for lane in seq.lanes}

    def _relay(self, groups: list[tuple[tuple[int, ...], list[_Cell]]]) -> None:
        """Copy each group of cells (those held by the same lanes) out through a spare lane, free
        every cell (metadata only), and lay the groups back one after another from cell 0: each
        lane's cells stay in position order, and only they are copied."""
        L, spare = self._L, self._free_lanes[0]
        saved = []
        for lanes, cells in groups:
            for start, end in _position_runs([c.pos for c in cells]):
                L.llama_memory_seq_cp(self._memory, lanes[0], spare, start, end)
            data = (ctypes.c_ubyte * L.llama_state_seq_get_size(self._ctx, spare))()
            written = L.llama_state_seq_get_data(self._ctx, data, len(data), spare)
            L.llama_memory_seq_rm(self._memory, spare, -1, -1)
            if not written:
                raise RuntimeError("llama.cpp could not copy cells out of its cache while compacting it")
            saved.append((lanes, data, written))
        L.llama_memory_clear(self._memory, False)
        for lanes, data, written in saved:
            if L.llama_state_seq_set_data(self._ctx, data, written, spare) != written:
                raise RuntimeError("llama.cpp could not lay cells back while compacting its cache")
            for lane in lanes:
                L.llama_memory_seq_cp(self._memory, spare, lane, -1, -1)
            L.llama_memory_seq_rm(self._memory, spare, -1, -1)

    def _live_cells(self) -> int:
        """Cells some sequence holds, each once (sequences sharing a prefix hold the same cells)."""
        return len({id(c) for seq in self._seqs.values()
                    for c in [*seq.prefix, *(c for lane in seq.lanes for c in lane.region.values())]})

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """One llama_decode of every entry; the logits rows asked for, in entry order."""
        L, b = self._L, self._batch
        self._allocated += len(entries)
        b.n_tokens = len(entries)
        for i, (token, pos, lane, wants) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wants
            b.seq_id[i][0] = lane
        status = L.llama_decode(self._ctx, b)
        if status != 0:
            raise CapacityError(f"llama_decode failed with status {status} ({len(entries)} tokens); "
                                "llama.cpp's cache may be full")
        rows = sum(1 for e in entries if e[3])
        out = np.ctypeslib.as_array(L.llama_get_logits(self._ctx), shape=(rows, self.vocab_size))
        return torch.from_numpy(out.copy())

    # -- cells and lanes ---------------------------------------------------------------------

    def _hold(self, lane: _Lane, cell: _Cell) -> None:
        """Make ``lane`` hold ``cell`` (replacing any cell it has at that position)."""
        if cell.lanes and lane.id in cell.lanes:
            return
        old = lane.region.get(cell.pos)
        if old is not None:
            if old.lanes <= {lane.id}:
                self._trash_cell(lane.id, old)
            self._L.llama_memory_seq_rm(self._memory, lane.id, old.pos, old.pos + 1)
            old.lanes.discard(lane.id)
        donor = next(iter(cell.lanes))
        self._L.llama_memory_seq_cp(self._memory, donor, lane.id, cell.pos, cell.pos + 1)
        cell.lanes.add(lane.id)
        lane.region[cell.pos] = cell

    def _drop_slot(self, seq: _Sequence, slot: int) -> None:
        """The slot names nothing; its cell leaves every lane once no slot names it."""
        cell = seq.slots.pop(slot, None)
        if cell is None:
            return
        cell.refs -= 1
        if cell.refs > 0:
            return
        holders = [lane for lane in seq.lanes if lane.region.get(cell.pos) is cell]
        if holders:
            self._trash_cell(holders[0].id, cell)
        for lane in holders:
            self._L.llama_memory_seq_rm(self._memory, lane.id, cell.pos, cell.pos + 1)
            del lane.region[cell.pos]
        cell.lanes.clear()

    def _trash_cell(self, lane_id: int, cell: _Cell) -> None:
        self._trash_cells(lane_id, cell.pos, cell.pos + 1)

    def _trash_cells(self, lane_id: int, start: int, end: int) -> None:
        """Row-invariantly, cells leaving their last lane go to the trash instead of being
        freed, so no later token takes their place below live cells."""
        if self.row_invariant:
            self._L.llama_memory_seq_cp(self._memory, lane_id, self._trash, start, end)
            self._trashed += end - start

    def _settle_lanes(self, seq: _Sequence) -> None:
        """Fold committed cells into each lane's prefix, and free lanes nothing needs: a lane
        (other than the base) with no region cell only repeats part of the prefix."""
        for lane in seq.lanes:
            while lane.prefix < seq.committed and lane.region.get(lane.prefix) is seq.prefix[lane.prefix]:
                del lane.region[lane.prefix]
                lane.prefix += 1
        for lane in [x for x in seq.lanes if x is not seq.base and not x.region]:
            seq.lanes.remove(lane)
            self._free_lane(lane)

    def _new_lane(self) -> _Lane:
        if not self._free_lanes:
            raise CapacityError(f"all {MAX_LANES} llama.cpp sequence ids are in use (sequences x tree branches)")
        return _Lane(self._free_lanes.pop(0))

    def _free_lane(self, lane: _Lane) -> None:
        if self.row_invariant:  # its cells go to the trash (those still on other lanes stay live there)
            self._L.llama_memory_seq_cp(self._memory, lane.id, self._trash, -1, -1)
            self._trashed += lane.prefix + len(lane.region)
        self._L.llama_memory_seq_rm(self._memory, lane.id, -1, -1)
        for cell in lane.region.values():
            cell.lanes.discard(lane.id)
        self._free_lanes.append(lane.id)


class TiledPromptSplits(PromptSplits):
    """Splits of a prompt that keep every row on the kernels one prefill runs it on.

    A prompt of 64 tokens or more is decoded in pieces cut at multiples of 512 (`_chain_pieces`),
    a piece of 64 tokens or more on tiled attention over aligned cells, a shorter one on the
    one-row attention. A split on a tile (a multiple of 64) keeps that when what follows it up to
    the next cut is 64 tokens or more, or when it is a cut itself (not leaving one token, which a
    prefill decodes with its neighbour). A shorter prompt runs on the one-row attention, and its
    matmuls on the tiled K-quant kernel when it is longer than a piece of ``piece`` tokens: on
    one-row kernels it may be split after any token, on the tiled matmul on any block where what
    follows stays on that kernel. Each length class is
    a `kind`, so a prefix written by a long prompt's prefill is never reused by a short one.
    tests/test_ggml_backend.py and tests/test_prefix_cache.py check splits bit for bit against
    one prefill."""

    block = 16
    exact = True  # every split it allows keeps each row on the kernels of one prefill

    def __init__(self, piece: int):
        self.piece = piece

    def kind(self, length: int) -> int:
        if length >= _TILE:
            return 2  # tiled attention
        return 1 if length > self.piece else 0  # the tiled matmul, or the one-row kernels

    def allows(self, at: int, length: int) -> bool:
        if not 0 < at < length:
            return False
        if length < _TILE:  # one-row kernels keep a row's sums wherever it sits; the tiled matmul, by block
            return self.kind(length - at) == self.kind(length) and (self.kind(length) == 0 or at % self.block == 0)
        if at % _TILE:
            return False
        if at % _PROMPT_CUT == 0:
            return length - at != 1
        return min(length, (at // _PROMPT_CUT + 1) * _PROMPT_CUT) - at >= _TILE

    def last_split(self, start: int, limit: int, length: int) -> int | None:
        if length < _TILE:
            return super().last_split(start, limit, length)
        return next((at for at in range(limit - limit % _TILE, start, -_TILE) if self.allows(at, length)), None)

    def next_split(self, start: int, length: int) -> int:
        if length < _TILE:
            return super().next_split(start, length)
        return next((at for at in range(start - start % _TILE + _TILE, length, _TILE) if self.allows(at, length)),
                    length)


def _restore_order(lane_cells: dict[int, list[_Cell]]) -> list[tuple[tuple[int, ...], list[_Cell]]] | None:
    """The live cells grouped by the lanes that hold them, in an order that keeps every lane's
    cells in position order when the groups are laid one after another; None where no such order
    exists (a lane whose cells go from one group to another and back)."""
    holders: dict[int, list[int]] = {}  # id(cell) -> the lanes holding it, in ascending lane id
    cells: dict[int, _Cell] = {}
    for lane_id in sorted(lane_cells):
        for cell in lane_cells[lane_id]:
            holders.setdefault(id(cell), []).append(lane_id)
            cells[id(cell)] = cell
    group_of = {key: tuple(lanes) for key, lanes in holders.items()}
    groups: dict[tuple[int, ...], list[_Cell]] = {}
    for key, group in group_of.items():
        groups.setdefault(group, []).append(cells[key])
    after: dict[tuple[int, ...], set[tuple[int, ...]]] = {g: set() for g in groups}
    waits = dict.fromkeys(groups, 0)
    for held in lane_cells.values():
        keys = [group_of[id(c)] for c in held]
        for x, y in zip(keys, keys[1:]):
            if x != y and y not in after[x]:
                after[x].add(y)
                waits[y] += 1
    ready = [g for g, n in waits.items() if n == 0]
    order = []
    while ready:
        g = ready.pop()
        order.append((g, sorted(groups[g], key=lambda c: c.pos)))
        for h in after[g]:
            waits[h] -= 1
            if waits[h] == 0:
                ready.append(h)
    return order if len(order) == len(groups) else None


def _position_runs(positions: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive positions in an ascending list."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def _same_cells(a: dict[int, _Cell], b: dict[int, _Cell]) -> bool:
    return len(a) == len(b) and all(b.get(p) is cell for p, cell in a.items())


def _chain_steps(mask: np.ndarray, region_slots: list[int], positions: list[int]) -> list[bool]:
    """chained[i]: token i+1 sees exactly what token i sees plus token i, one position on, so it
    goes on token i's lane without a search (prefill, verify and glue chains)."""
    n = len(region_slots)
    if n < 2:
        return []
    expected = mask[:-1].copy()
    expected[np.arange(n - 1), region_slots[:-1]] = True
    same = (mask[1:] == expected).all(axis=1)
    steps = np.diff(np.asarray(positions)) == 1
    return (same & steps).tolist()


def _pieces(n: int, size: int) -> list[tuple[int, int]]:
    """[a, b) ranges of at most ``size`` of n entries, none of a single entry unless n == 1 (a
    one-token forward on several threads splits a long cache across them)."""
    bounds = [*range(0, n, size), n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        bounds[-2] -= 1
    return list(zip(bounds, bounds[1:]))


def _packed(spans: list[list[int]], limit: int) -> list[list[int]]:
    """Spans packed in order into groups of at most ``limit`` entries (a span longer than that
    alone)."""
    groups: list[list[int]] = []
    for span in spans:
        if groups and len(groups[-1]) + len(span) <= limit:
            groups[-1] += span
        else:
            groups.append(list(span))
    return groups


def _chain_pieces(first: int, n: int) -> list[tuple[int, int]]:
    """[a, b) ranges of a chain of n >= 64 tokens from position ``first``, cut where a position
    is a multiple of 512 (so a prompt is always cut the same way), a single-token end piece
    taking one more token from its neighbour."""
    bounds = [0, *[i for i in range(1, n) if (first + i) % _PROMPT_CUT == 0], n]
    if bounds[1] - bounds[0] == 1:
        bounds[1] += 1
    if bounds[-1] - bounds[-2] == 1:
        bounds[-2] -= 1
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
