"""The round buffers' interface (trtssd.runtime.transport.RoundBuffers), the same tests for every
implementation: shared host memory (runs everywhere) and CUDA IPC (GPU only: marked ``gpu`` and
skipped without CUDA; unverified until it has run on one).

Each test runs the writer (the draft's side) in a second process and the reader (the target's
side) here, as the ranks do: a CUDA IPC handle cannot even be opened by the process that made it.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from trtssd.config import RuntimeConfig, Transport
from trtssd.runtime.cuda_ipc import CudaIpcBuffers
from trtssd.runtime.protocol import BufferLayout
from trtssd.runtime.transport import SharedBuffers

HAS_CUDA = torch.cuda.is_available()
KINDS = ["host", pytest.param("cuda_ipc", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])]
B, K, V = 3, 4, 1031
REPLY_TIMEOUT_S = 120.0  # a child importing torch (and initialising CUDA) on a busy machine
CPU = torch.device("cpu")


def _expected(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``seed``'s full buffer contents: exact on every device (small integers and powers of two)."""
    tokens = seed * 1000 + torch.arange(B * K, dtype=torch.int64).view(B, K)
    probs = seed + (torch.arange(B * K * V, dtype=torch.float32) % 1024).view(B, K, V) * 2.0**-10
    return tokens, probs


def _write(buffers, kind: str, buffer: int, rows: int, seed: int, with_probs: bool) -> None:
    tokens, probs = _expected(seed)
    if kind == "cuda_ipc":
        tokens, probs = tokens.to(buffers.device), probs.to(buffers.device)
        # Hold the stream ~tens of ms before the copies: a reader that did not wait for the
        # event would find the previous round's values.
        torch.cuda._sleep(50_000_000)  # noqa: SLF001 - torch's own test helper
    buffers.tokens(buffer)[:rows].copy_(tokens[:rows])
    if with_probs:
        buffers.probs(buffer)[:rows].copy_(probs[:rows])
    buffers.publish(buffer)


def _writer(kind: str, layout: BufferLayout, conn) -> None:
    """The draft's side, in its own process: open the buffers, then write each requested round."""
    if kind == "host":
        buffers = SharedBuffers.attach_posix(layout)
        conn.send("attached")
    else:
        buffers = CudaIpcBuffers.create(layout, "cuda:0")
        conn.send(buffers.export())
    while (msg := conn.recv()) is not None:
        _write(buffers, kind, *msg)
        conn.send(("published", msg[0]))
    buffers.close()
    conn.send("closed")


class Pair:
    """The reader's buffers here, and the writer process."""

    def __init__(self, kind: str):
        self.kind = kind
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.conn, child = ctx.Pipe()
        if kind == "host":
            self.buffers = SharedBuffers.create_posix(B, K, V)  # the target creates, the draft attaches
            layout = self.buffers.layout
        else:
            layout = BufferLayout(B, K, V, None, Transport.CUDA_IPC.value, "cuda:0")
        self.process = ctx.Process(target=_writer, args=(kind, layout, child), daemon=True)
        self.process.start()
        opened = self._recv()  # the writer has its side open
        if kind == "cuda_ipc":  # the draft allocates, the target maps once
            self.buffers = CudaIpcBuffers.attach(layout, opened)
        else:
            assert opened == "attached"

    def _recv(self):
        assert self.conn.poll(REPLY_TIMEOUT_S), "the writer process did not answer"
        return self.conn.recv()

    def round(self, buffer: int, rows: int, seed: int, with_probs: bool = True):
        """Ask for a round, wait for the writer's reply (as the target waits for the draft's), receive it."""
        self.conn.send((buffer, rows, seed, with_probs))
        assert self._recv() == ("published", buffer)
        return self.buffers.receive(buffer, rows, with_probs, CPU)

    def close(self) -> None:
        # The reader lets go first, as the target does before its draft exits: the writer's
        # CUDA memory is then no longer mapped anywhere when it is freed.
        self.buffers.close()
        self.conn.send(None)
        assert self._recv() == "closed"
        self.process.join(30)
        assert self.process.exitcode == 0


@pytest.fixture(params=KINDS)
def pair(request):
    p = Pair(request.param)
    yield p
    p.close()


def test_round_trip_between_two_processes(pair):
    """Rounds alternate between the two buffers with varying rows; every received row is
    exactly what the writer wrote for that round, with or without q' rows."""
    plan = [(0, 3, 1, True), (1, 1, 2, True), (0, 2, 3, False), (1, 3, 4, True), (0, 3, 5, True)]
    for buffer, rows, seed, with_probs in plan:
        tokens, probs = pair.round(buffer, rows, seed, with_probs)
        want_tokens, want_probs = _expected(seed)
        assert tokens.device == CPU and tokens.dtype == torch.int64 and tuple(tokens.shape) == (rows, K)
        assert torch.equal(tokens, want_tokens[:rows])
        if with_probs:
            assert probs.dtype == torch.float32 and tuple(probs.shape) == (rows, K, V)
            assert torch.equal(probs, want_probs[:rows])
        else:
            assert probs is None


def test_double_buffering_keeps_the_round_being_read(pair):
    """While the target still holds round t (buffer 0), the draft writes round t+1 into buffer 1:
    round t's rows are unchanged."""
    tokens_t, probs_t = pair.round(0, B, 10)
    tokens_next, probs_next = pair.round(1, B, 11)
    want_t, want_next = _expected(10), _expected(11)
    assert torch.equal(tokens_t, want_t[0]) and torch.equal(probs_t, want_t[1])
    assert torch.equal(tokens_next, want_next[0]) and torch.equal(probs_next, want_next[1])


def test_writer_views_have_the_layout(pair):
    for buffer in (0, 1):
        assert tuple(pair.buffers.tokens(buffer).shape) == (B, K)
        assert pair.buffers.tokens(buffer).dtype == torch.int64
        assert tuple(pair.buffers.probs(buffer).shape) == (B, K, V)
        assert pair.buffers.probs(buffer).dtype == torch.float32
    assert (pair.buffers.layout.max_batch, pair.buffers.layout.k, pair.buffers.layout.vocab_size) == (B, K, V)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_ipc_receive_on_a_gpu():
    """The target on a GPU gets the rows there (a device copy, or a peer copy from another GPU)."""
    p = Pair("cuda_ipc")
    try:
        p.conn.send((1, 2, 7, True))
        assert p._recv() == ("published", 1)
        target = torch.device("cuda", torch.cuda.device_count() - 1)  # another GPU when there is one
        tokens, probs = p.buffers.receive(1, 2, True, target)
        assert tokens.device == target and probs.device == target
        want_tokens, want_probs = _expected(7)
        assert torch.equal(tokens.cpu(), want_tokens[:2]) and torch.equal(probs.cpu(), want_probs[:2])
    finally:
        p.close()


def test_host_receive_on_the_host_is_a_view():
    """On CPU the host transport hands over views, as before the interface existed (no copy)."""
    layout = BufferLayout(B, K, V, None)
    buffers = SharedBuffers(layout, bytearray(SharedBuffers.nbytes(layout)), lambda: None)
    _write(buffers, "host", 1, 2, 5, True)
    tokens, probs = buffers.receive(1, 2, True, CPU)
    assert tokens.data_ptr() == buffers.tokens(1).data_ptr() and probs.data_ptr() == buffers.probs(1).data_ptr()
    assert buffers.receive(0, 1, False, CPU)[1] is None


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")
def test_cuda_ipc_without_cuda_fails_clearly():
    layout = BufferLayout(B, K, V, None, Transport.CUDA_IPC.value, "cpu")
    with pytest.raises(ValueError, match="CUDA IPC buffers need a CUDA device"):
        CudaIpcBuffers.create(layout, "cpu")


def test_transport_follows_the_draft_device():
    assert RuntimeConfig().resolved_transport is Transport.HOST
    assert RuntimeConfig(draft_device="cuda:0").resolved_transport is Transport.CUDA_IPC
