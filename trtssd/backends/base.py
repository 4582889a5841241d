"""The executor protocol: the only surface the runtime uses to run a model.

Both ranks call it: the target for prefill and K+1-token verification, the draft for prefill,
glue decode and tree decode. The torch backend implements it on CPU (and CUDA); a TensorRT-LLM
executor may implement it for the target.

KV layout, per sequence: storage slots ``[0, committed)`` hold the committed prefix and are
visible to every new token. Slots from ``committed`` on are the *region*: verification tokens,
glue tokens and tree scratch live there, each new token seeing only the region slots its mask
allows. Writing the region never changes the committed prefix, so discarding is free and
committing accepted tokens is a length update (no copy). Logical positions (for RoPE) are given
per token and are independent of the storage slot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, TypeVar

import torch


class CapacityError(RuntimeError):
    """A request does not fit in the executor's memory budget (raised, never a crash)."""


class PromptSplits:
    """Where a prompt's prefill may be split in two forwards, its first ``at`` tokens and then the
    rest, and still write the KV and logits of one forward over it all: where a cached prefix may
    end (trtssd/runtime/prefix_cache.py, in whole blocks of ``block`` tokens) and where chunked
    prefill may cut a prompt (trtssd/runtime/scheduler.py). By default anywhere: an executor
    whose rows depend on the forward's shape overrides it."""

    block = 16  # tokens per cached block (vLLM's default block size)
    # Whether a split prefill writes the very bits of one forward over it all. Where it does not
    # (torch's matmuls round differently by row count) a split is equal only up to rounding, and
    # a seeded sampled request, which promises the same draws, takes no cached prefix.
    exact = False

    def kind(self, length: int) -> int:
        """Which kernels one forward's prefill of a ``length``-token prompt runs on: a cached
        prefix is only reused by a prompt of the kind of the one whose prefill wrote it."""
        return 0

    def allows(self, at: int, length: int) -> bool:
        return 0 < at < length

    def last_split(self, start: int, limit: int, length: int) -> int | None:
        """The last allowed split in (start, limit], or None."""
        return next((at for at in range(min(limit, length - 1), start, -1) if self.allows(at, length)), None)

    def next_split(self, start: int, length: int) -> int:
        """The first allowed split after ``start``, or ``length`` when there is none."""
        return next((at for at in range(start + 1, length) if self.allows(at, length)), length)


@dataclass(frozen=True)
class Chunk:
    """One sequence's tokens in one forward pass.

    tokens:    [n] int64 token ids.
    positions: [n] int64 logical positions (RoPE).
    slots:     [n] int64 storage slots, all >= the sequence's committed length.
    mask:      [n, R] bool, token i may attend region slot ``committed + r`` iff mask[i, r].
               A token must see its own slot. R covers every region slot any token uses.
    """

    seq_id: int
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    last_logits_only: bool = False  # prefill needs only the last row; saves a [n, V] projection
    # A sequence's prompt: an executor decodes it as it decodes prompts (the same KV) whatever
    # logits it returns (prompt logprobs ask for every row).
    prompt: bool = False


def chunk_on_host(c: Chunk) -> Chunk:
    """A chunk with its tensors on the host, so any process can unpickle it."""
    moved = {f.name: getattr(c, f.name).cpu() for f in dataclasses.fields(c)
             if isinstance(getattr(c, f.name), torch.Tensor) and getattr(c, f.name).device.type != "cpu"}
    return dataclasses.replace(c, **moved) if moved else c


def chain_chunk(
    seq_id: int, tokens: Sequence[int] | torch.Tensor, start: int, last_logits_only: bool = False
) -> Chunk:
    """A causal run of tokens appended at logical position and slot ``start`` (= committed)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n = tokens.numel()
    idx = torch.arange(start, start + n, dtype=torch.long)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    return Chunk(seq_id, tokens, idx, idx, mask, last_logits_only)


@dataclass(frozen=True)
class ExecutorCapabilities:
    """What an executor can do beyond the calls every executor has, declared in one place: the
    runtime reads these, never an executor's attributes, to decide what it may ask of it."""

    max_batch_tokens: int  # most tokens one forward takes (chunked prefill groups prompts under it)
    # Where a prompt's prefill may be split in two forwards and still give one forward's KV and
    # logits (chunked prefill, the end of a cached prefix).
    prompt_splits: PromptSplits = field(default_factory=PromptSplits)
    shares_prefix: bool = False  # `share_prefix`: the prefix cache may reuse a prompt's KV
    # `save_prefix` / `load_prefix`: a kept prompt's KV waits in host memory, not as a sequence
    # (llama.cpp attends over every cell of its cache in each forward).
    saves_prefix: bool = False
    lends_threads: bool = False  # `set_threads`: plain rounds may borrow the draft's cores


class Executor(Protocol):
    """What a model backend must provide (see module docstring for the KV contract)."""

    vocab_size: int
    max_seq_len: int  # longest sequence (prompt + output + region) one slot can hold
    capabilities: ExecutorCapabilities
    # Seconds of cache upkeep paid inside forwards so far (a ggml compaction); 0 where there is none.
    # Load control takes it out of a round's time.
    upkeep_s: float

    def add_sequence(self, seq_id: int) -> None:
        """Reserve KV storage for a new sequence; raises CapacityError when none is free."""

    def release(self, seq_id: int) -> None:
        """Free a sequence's storage (idempotent)."""

    def committed(self, seq_id: int) -> int:
        """Number of committed tokens (slots [0, n) are the prefix)."""

    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Run the model over every chunk in one batched pass; returns fp32 logits [n_i, V]
        per chunk ([1, V] when ``last_logits_only``). Writes KV into the chunk's slots;
        commits nothing."""

    def commit(self, seq_id: int, n_tokens: int) -> None:
        """Mark region slots [committed, committed + n_tokens) as committed prefix."""

    def share_prefix(self, src_seq_id: int, dst_seq_id: int, n_tokens: int) -> None:
        """Give the new sequence ``dst_seq_id`` (nothing written yet) the first ``n_tokens``
        committed tokens of ``src_seq_id`` as its committed prefix: the prefix cache's reuse of a
        prompt's KV. Called only where ``capabilities.shares_prefix``."""

    def save_prefix(self, seq_id: int, n_tokens: int) -> object:
        """A copy of the first ``n_tokens`` committed tokens' KV of ``seq_id``, outside the
        executor (the sequence may then be released), whose ``size`` is the bytes it holds (the
        prefix cache's memory bound). Called only where ``capabilities.saves_prefix``."""

    def load_prefix(self, seq_id: int, saved: object, n_tokens: int) -> None:
        """Lay the first ``n_tokens`` of a `save_prefix` copy into the new sequence ``seq_id`` as
        its committed prefix. Called only where ``capabilities.saves_prefix``."""

    def set_threads(self, threads: int, split_single_rows: bool = False) -> None:
        """Run the coming forwards on ``threads`` threads (trtssd/runtime/core_lending.py). Called
        only where ``capabilities.lends_threads``."""

    def cost_identity(self) -> dict[str, Any]:
        """What this executor's forward costs depend on besides the machine (the model's shape,
        how it runs, its sizes), as JSON-ready values: the key of a stored calibration."""

    def spare_rows(self, tokens: int) -> int:
        """Tokens a forward of ``tokens`` tokens could carry besides them at no extra cost: a
        ggml target pads a lone token over a long cache with a filler row (trtssd/backends/
        ggml_backend.py), in which a plain round verifies a guess instead. 0 for most executors."""

    def close(self) -> None:
        """Free the model and its KV storage now, not when the executor is garbage collected
        (idempotent; no other call follows). Whoever started the executor closes it: a closed
        ``LLM`` holds no model memory even while something still refers to it."""

    def copy_slots(self, seq_id: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV at storage slots ``src`` (already written, not committed) to slots ``dst``
        (at or after the committed prefix), in every layer, as if gathered before scattering.
        The draft uses it to turn a tree branch's scratch slots into the sequence's chain
        instead of decoding those tokens again (the KV depends only on token, logical position
        and what the token saw, all unchanged)."""


def check_chunk(c: Chunk, committed: int, max_seq_len: int, vocab_size: int) -> tuple[int, int]:
    """Validate one chunk against its sequence's committed length; returns (n tokens, highest
    slot + 1). Every executor checks its inputs with this one function."""
    where = f"chunk of seq {c.seq_id}"
    for name in ("tokens", "positions", "slots"):
        t = getattr(c, name)
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{where}: {name} must be an integer tensor, got {t.dtype}")
    if c.tokens.dim() != 1 or c.tokens.numel() == 0:
        raise ValueError(f"{where}: tokens must be a non-empty 1-D tensor, got shape {tuple(c.tokens.shape)}")
    n = c.tokens.numel()
    if tuple(c.positions.shape) != (n,) or tuple(c.slots.shape) != (n,):
        raise ValueError(f"{where}: positions and slots must have shape ({n},), got "
                         f"{tuple(c.positions.shape)} and {tuple(c.slots.shape)}")
    if c.mask.dtype != torch.bool or c.mask.dim() != 2 or c.mask.shape[0] != n or c.mask.shape[1] < 1:
        raise ValueError(f"{where}: mask must be bool [{n}, R>=1], got {c.mask.dtype} {tuple(c.mask.shape)}")
    region = c.mask.shape[1]
    if committed + region > max_seq_len:
        raise CapacityError(f"{where}: region ends at slot {committed + region} > max_seq_len {max_seq_len}")
    lo, hi = int(c.slots.min()), int(c.slots.max())
    if lo < committed or hi >= committed + region:
        raise ValueError(f"{where}: slots must lie in the region [{committed}, {committed + region}), "
                         f"got [{lo}, {hi}]")
    if torch.unique(c.slots).numel() != n:
        raise ValueError(f"{where}: two tokens write the same slot")
    own = (c.slots.to(device=c.mask.device, dtype=torch.long) - committed)[:, None]
    if not bool(c.mask.gather(1, own).all()):
        raise ValueError(f"{where}: every token's mask must include its own slot")
    if int(c.positions.min()) < 0:
        raise ValueError(f"{where}: positions must be >= 0")
    if int(c.tokens.min()) < 0 or int(c.tokens.max()) >= vocab_size:
        raise ValueError(f"{where}: token ids must be in [0, {vocab_size})")
    return n, hi + 1


def check_share(src_seq_id: int, src_committed: int, dst_seq_id: int, dst_written: bool, n_tokens: int) -> None:
    """Validate a `share_prefix` call; every executor checks it with this one function."""
    if dst_written:
        raise ValueError(f"seq {dst_seq_id} must be new (nothing written) to share a prefix")
    if not isinstance(n_tokens, int) or not 0 < n_tokens <= src_committed:
        raise ValueError(f"n_tokens must be an int in [1, {src_committed}] (seq {src_seq_id}'s committed tokens); "
                         f"got {n_tokens!r}")


S = TypeVar("S")


def find_sequence(seqs: Mapping[int, S], seq_id: int) -> S:
    """An executor's record of ``seq_id``, or the error every executor gives for an unknown id."""
    try:
        return seqs[seq_id]
    except KeyError:
        raise ValueError(f"unknown seq_id {seq_id}; call add_sequence first") from None


def chunk_sequences(chunks: Sequence[Chunk], seqs: Mapping[int, S]) -> list[S]:
    """The record of each chunk's sequence; a sequence may appear in one chunk of a forward only."""
    found: list[S] = []
    for c in chunks:
        seq = find_sequence(seqs, c.seq_id)
        if any(s is seq for s in found):
            raise ValueError(f"seq {c.seq_id} appears in more than one chunk of this forward")
        found.append(seq)
    return found
