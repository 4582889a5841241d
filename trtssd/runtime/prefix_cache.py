"""Prefix caching: a prompt's KV kept and found again by its tokens, so a request that repeats a
prefix (a system prompt, earlier turns of a chat, tool schemas) prefills only the rest. Each rank
keeps its own, over its own executor. Why kept prompts leave llama.cpp's cache, and why the cache
holds the same with speculation on and off: docs/design/prefix-cache.md.

- Prompts are cut into blocks of the executor's `PromptSplits.block` tokens. A block is known by
  the hash of its tokens and of every block before it (vLLM's chained block hash), so a hash
  names a whole prefix, and the longest run of known hashes finds the cached prompt sharing the
  longest prefix; the shared prefix then runs on token by token past the last whole block (as
  llama-server's prompt cache reuses a prompt), up to where the executor allows a split.
- A *holder* is a sequence in the executor whose committed prompt holds those blocks: a running
  one, or a finished one kept for reuse. A new sequence shares the holder's prefix through
  `Executor.share_prefix` (llama.cpp: the same cells under one more sequence id; torch: a copy of
  the rows), then prefills what follows it.
- Finished holders are kept up to ``max_kept`` (None: no count of its own) and evicted least
  recently used first, also when the executor has no room for a new sequence, so the cache never
  refuses a request. An executor that can copy a prefix out (`save_prefix`, llama.cpp) keeps a
  finished holder's prompt KV in host memory, up to ``max_mib`` MiB of it, and releases the
  sequence; a hit loads it back (`load_prefix`). Elsewhere (torch) a kept holder stays a sequence
  of the executor, so with no count of its own the cache keeps as many as the executor has room
  for.
- A cached prefix gives a fresh prefill's KV and logits: it ends only where the executor allows a
  prompt to be split (`PromptSplits.allows`), it is found only by prompts whose prefill runs on
  the kernels that wrote it (`PromptSplits.kind`, the root of the block hashes), and only KV a
  prompt's prefill wrote is indexed, never generated tokens' (decoded in other forward shapes,
  their KV can differ in the last bits from what a prefill of the same tokens writes).
- A hit is checked token by token against the holder's prompt: a hash collision costs a miss,
  never a wrong prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from trtssd.backends.base import CapacityError, Executor, PromptSplits


def block_hashes(tokens: list[int], block: int, kind: int = 0) -> list[int]:
    """The chained hash of each whole block of ``tokens``, from a root of the prompt's ``kind``."""
    hashes, parent = [], kind
    for start in range(0, len(tokens) - block + 1, block):
        parent = hash((parent, tuple(tokens[start:start + block])))
        hashes.append(parent)
    return hashes


@dataclass
class _Holder:
    prompt: list[int]
    hashes: list[int]
    saved: object = None  # the executor's copy of the indexed prompt's KV, once the sequence is released


class PrefixCache:
    def __init__(self, executor: Executor, max_kept: int | None, max_mib: int | None = None):
        for name, value in (("prefix_cache_seqs", max_kept), ("prefix_cache_mib", max_mib)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None; got {value!r}")
        self.executor = executor
        self.max_kept = max_kept if executor.capabilities.shares_prefix else 0
        self.max_bytes = None if max_mib is None else max_mib << 20  # of saved prompts (None: no limit)
        self._saved_bytes = 0
        self.splits: PromptSplits = executor.capabilities.prompt_splits
        self._holders: dict[int, _Holder] = {}  # seq_id -> its indexed prompt (running or kept)
        self._by_hash: dict[int, dict[int, None]] = {}  # block hash -> holders (insertion-ordered)
        self._kept: OrderedDict[int, None] = OrderedDict()  # finished holders, least recently used first

    @property
    def enabled(self) -> bool:
        return self.max_kept != 0

    def reuse_keeps_bits(self, params) -> bool:
        """Whether a request with these SamplingParams may take a cached prefix: always, unless
        it is seeded and sampled (its seed promises the same draws) and a cached prefix is equal
        to a prefill only up to rounding on this executor."""
        return self.splits.exact or not params.seeded_sampling

    def start(self, seq_id: int, prompt: list[int], reuse: bool = True) -> int:
        """Add ``seq_id`` to the executor with the longest cached prefix of its prompt; returns
        that prefix's length (0 on a miss). ``reuse`` False starts it empty (a request that
        wants every prompt row's logits)."""
        found = self._lookup(prompt) if reuse and self.enabled else None
        if found is not None and found[0] in self._kept:
            self._kept.move_to_end(found[0])  # the last to go if the executor needs room for seq_id
        self._add(seq_id)
        if found is None or found[0] not in self._holders:
            return 0  # a miss, or the holder was the only kept sequence that could give up its room
        holder, n = found
        saved = self._holders[holder].saved
        if saved is None:
            self.executor.share_prefix(holder, seq_id, n)
        else:
            self.executor.load_prefix(seq_id, saved, n)
        return n

    def index(self, seq_id: int, prompt: list[int]) -> None:
        """Make a sequence whose prompt is prefilled and committed a holder of its blocks."""
        if not self.enabled:
            return
        hashes = block_hashes(prompt, self.splits.block, self.splits.kind(len(prompt)))
        if not hashes:
            return  # shorter than a block: nothing to find it by
        self._holders[seq_id] = _Holder(list(prompt), hashes)
        for h in hashes:
            self._by_hash.setdefault(h, {})[seq_id] = None

    def finish(self, seq_id: int) -> None:
        """A sequence ended: kept for reuse if it holds blocks, else released."""
        holder = self._holders.get(seq_id)
        if holder is None:
            self.executor.release(seq_id)
            return
        if self.executor.capabilities.saves_prefix:
            holder.saved = self.executor.save_prefix(seq_id, len(holder.prompt))
            self._saved_bytes += holder.saved.size
            self.executor.release(seq_id)
        self._kept[seq_id] = None
        while self._kept and self._over_limit():
            self._evict_oldest()

    def _over_limit(self) -> bool:
        return ((self.max_kept is not None and len(self._kept) > self.max_kept)
                or (self.max_bytes is not None and self._saved_bytes > self.max_bytes))

    def _lookup(self, prompt: list[int]) -> tuple[int, int] | None:
        """(holder, tokens) of the longest reusable cached prefix, or None. Found by whole blocks,
        then followed token by token along the prompts holding the last block found (less than a
        block more: a prompt sharing the next whole block would hold its hash), so a prompt that
        leaves a cached one inside a block still reuses what they share."""
        holders, n = {}, 0
        for i, h in enumerate(block_hashes(prompt, self.splits.block, self.splits.kind(len(prompt)))):
            end = (i + 1) * self.splits.block
            found = self._by_hash.get(h)
            if end >= len(prompt) or not found:
                break
            if self._holders[next(reversed(found))].prompt[:end] != prompt[:end]:
                break  # a hash collision
            holders, n = found, end
        best = None
        for holder in reversed(holders):  # the newest first: the likeliest to stay
            held, shared = self._holders[holder].prompt, n
            limit = min(len(held), len(prompt) - 1)  # the last prompt token's logits must be computed
            while shared < limit and held[shared] == prompt[shared]:
                shared += 1
            if held[:n] == prompt[:n] and (best is None or shared > best[1]):
                best = (holder, shared)
        at = None if best is None else self.splits.last_split(0, best[1], len(prompt))
        return None if at is None else (best[0], at)

    def _add(self, seq_id: int) -> None:
        while True:
            try:
                self.executor.add_sequence(seq_id)
                return
            except CapacityError:
                if not any(self._holders[s].saved is None for s in self._kept):
                    raise
                self._evict_oldest(live=True)

    def _evict_oldest(self, live: bool = False) -> None:
        """Forget the least recently used kept holder (``live``: of those the executor holds)."""
        seq_id = next(s for s in self._kept if not live or self._holders[s].saved is None)
        del self._kept[seq_id]
        holder = self._holders.pop(seq_id)
        for h in holder.hashes:
            holders = self._by_hash[h]
            del holders[seq_id]
            if not holders:
                del self._by_hash[h]
        if holder.saved is None:
            self.executor.release(seq_id)
        else:
            self._saved_bytes -= holder.saved.size
