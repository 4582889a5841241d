"""Every message between the target rank and the draft rank, used by both sides.

Control messages are small pickled dataclasses sent over MPI. Bulk tensors (the K proposal
tokens per row and the q' rows they were sampled from) travel through the two buffers of a
`transport.RoundBuffers`; a reply says which of the two buffers holds its rows. Row i of a reply answers
``outcomes[i]`` of the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtssd.config import ModelRef, RuntimeConfig, Source, SpeculativeConfig
from trtssd.sampling import SamplingParams

CONTROL_TAG = 11  # target -> draft
REPLY_TAG = 12  # draft -> target


@dataclass(frozen=True)
class BufferLayout:
    """Shape of one shared buffer; two of them alternate per round."""

    max_batch: int
    k: int
    vocab_size: int
    shm_name: str | None  # POSIX shared memory name (connect mode); None = MPI-3 window (or CUDA IPC)
    transport: str = "host"  # "host" (shared host memory) or "cuda_ipc" (the draft's device buffer, mapped)
    device: str = "cpu"  # cuda_ipc: the draft's device, where the buffer lives


@dataclass(frozen=True)
class Hello:
    """First message from the target: everything the draft needs to start serving."""

    spec: SpeculativeConfig
    runtime: RuntimeConfig
    layout: BufferLayout
    draft_model: ModelRef
    max_seq_len: int  # KV length the draft needs per sequence (prompt + output + glue + tree region)
    doorbell: str | None = None  # the name the draft listens on for the target's rings (transport.Doorbell)


@dataclass(frozen=True)
class Ready:
    """The draft's answer to Hello: it has loaded its model and attached the buffers."""

    vocab_size: int
    load_time_s: float
    pid: int  # the draft process (lets tests and operators find it)
    buffers: object | None = None  # cuda_ipc: the draft's CudaIpcHandles, for the target to map once
    step_s: dict[int, float] | None = None  # calibrated seconds of a draft forward by rows (None: not timed)


@dataclass(frozen=True)
class Prefill:
    """A new sequence: the draft prefills its prompt (overlapping the target's own prefill). Under
    chunked prefill the prompt comes again for each piece, ``upto`` where the piece ends."""

    seq_id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    upto: int | None = None  # prefill up to this prompt token (None: all of it)
    # Another sample of the same request (SamplingParams.n) whose prompt the draft holds whole:
    # its KV is shared (Executor.share_prefix) instead of prefilled; prefilled if no longer held.
    fork_of: int | None = None
    # The target's end tokens, which min_tokens holds back on the draft too (the draft has no tokenizer).
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What the target emitted since the draft's last speculation for a sequence: k of its
    drafts accepted, then the bonus token, then ``plain`` tokens from rounds the target decoded
    without the draft (load control). The last emitted token is the new pending one.

    For a sequence's first round k is 0 and the bonus is the first sampled token.
    """

    seq_id: int
    num_accepted: int
    bonus: int
    plain: tuple[int, ...] = ()
    num_drafts: int | None = None  # proposals the target verified (K per round); None: all K
    # The round verified the grammar's forced tokens instead of this speculation (structured
    # outputs): the outcome says what was emitted, not how the speculation fared.
    grammar: bool = False


@dataclass(frozen=True)
class SpeculateRequest:
    round_id: int  # the target's round counter; the reply must carry the same one
    outcomes: tuple[Outcome, ...]
    buffer: int  # which of the two shared buffers the reply must write (alternates per round)
    verify_time_s: float  # the target's last verify time, for the backup policy
    released: tuple[int, ...] = ()  # sequences finished since the last request


@dataclass(frozen=True)
class SpeculateReply:
    round_id: int
    buffer: int
    sources: tuple[Source, ...]  # per row: where its speculation came from
    point_mass: tuple[bool, ...]  # per row: deterministic proposal (verified as a point mass)
    has_probs: bool  # q' rows were written (False when every row is greedy or point mass)
    answer_time_s: float  # draft time spent answering this request
    prespec_time_s: float  # draft time spent pre-speculating after the previous reply
    tree_branches: int = 0  # tree branches per sequence that pre-speculation used (auto fan-out's pick)
    cached_tokens: tuple[int, ...] = ()  # per row: prompt tokens the draft's prefix cache gave it


@dataclass(frozen=True)
class Release:
    seq_ids: tuple[int, ...]


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class DraftError:
    """The draft hit an exception; the target degrades to AR mode."""

    message: str
