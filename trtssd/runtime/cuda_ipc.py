"""`CudaIpcBuffers`: the round buffers on the draft's GPU, mapped by the target through CUDA IPC.

Unverified: never run on a GPU. Written against torch's own CUDA IPC path (what
``torch.multiprocessing`` uses to pass CUDA tensors between processes): the draft allocates the
two buffers on its device and exports them with ``torch.multiprocessing.reductions.reduce_tensor``
(``cudaIpcGetMemHandle`` underneath); the target rebuilds them once at start-up with
``rebuild_cuda_tensor`` (``cudaIpcOpenMemHandle``). One interprocess CUDA event per buffer
(``torch.cuda.Event(interprocess=True)``, ``ipc_handle`` / ``from_ipc_handle``) is recorded by the
draft after its writes and waited on by the target before it reads, so the target never reads a
half-written round even though the draft's copies are asynchronous on its stream.

A process cannot open its own IPC handles (CUDA refuses), so both sides are always two processes;
the in-process draft (``launch="local"``) keeps host buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import reduce_tensor, rebuild_cuda_tensor

from trtssd.runtime.protocol import BufferLayout


@dataclass(frozen=True)
class CudaIpcHandles:
    """What the target needs to map the draft's buffers (picklable: sent in the Ready message)."""

    device_index: int  # the draft's GPU, where the buffers live
    tokens: tuple  # rebuild_cuda_tensor's arguments for the int64 [2, B, K] tokens
    probs: tuple  # and for the fp32 [2, B, K, V] q' rows
    events: tuple[bytes, bytes]  # one interprocess event handle per buffer


class CudaIpcBuffers:
    """`RoundBuffers` (trtssd/runtime/transport.py) in device memory of the draft's GPU: made with
    ``create`` on the draft (the owner) and ``attach`` on the target."""

    def __init__(self, layout: BufferLayout, tokens: torch.Tensor, probs: torch.Tensor,
                 events: list[torch.cuda.Event], owner: bool):
        self.layout = layout
        self.device = tokens.device
        self._tokens = tokens  # [2, B, K] int64
        self._probs = probs  # [2, B, K, V] fp32
        self._events = events
        self._owner = owner

    @classmethod
    def create(cls, layout: BufferLayout, device: torch.device | str) -> "CudaIpcBuffers":
        """The draft side: allocate both buffers and their events on ``device``."""
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC buffers need a CUDA device; got {device}")
        B, K, V = layout.max_batch, layout.k, layout.vocab_size
        with torch.cuda.device(device):
            tokens = torch.zeros(2, B, K, dtype=torch.int64, device=device)
            probs = torch.zeros(2, B, K, V, dtype=torch.float32, device=device)
            # interprocess events cannot time (CUDA's rule); blocking=False: synchronize spins.
            events = [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True) for _ in range(2)]
        return cls(layout, tokens, probs, events, owner=True)

    def export(self) -> CudaIpcHandles:
        """The draft side: handles for the target (call once, after ``create``)."""
        if not self._owner:
            raise RuntimeError("only the side that created the buffers can export them")
        with torch.cuda.device(self.device):
            events = tuple(bytes(e.ipc_handle()) for e in self._events)
        return CudaIpcHandles(self.device.index, reduce_tensor(self._tokens)[1], reduce_tensor(self._probs)[1],
                              events)

    @classmethod
    def attach(cls, layout: BufferLayout, handles: CudaIpcHandles) -> "CudaIpcBuffers":
        """The target side: map the draft's buffers and open its events (once, at start-up)."""
        device = torch.device("cuda", handles.device_index)
        with torch.cuda.device(device):
            tokens = rebuild_cuda_tensor(*handles.tokens)
            probs = rebuild_cuda_tensor(*handles.probs)
            events = [torch.cuda.Event.from_ipc_handle(device, h) for h in handles.events]
        B, K, V = layout.max_batch, layout.k, layout.vocab_size
        if tuple(tokens.shape) != (2, B, K) or tuple(probs.shape) != (2, B, K, V):
            raise ValueError(f"mapped CUDA IPC buffers {tuple(tokens.shape)} / {tuple(probs.shape)} do not match "
                             f"the layout (B={B}, K={K}, V={V})")
        return cls(layout, tokens, probs, events, owner=False)

    def tokens(self, buffer: int) -> torch.Tensor:
        return self._tokens[buffer]

    def probs(self, buffer: int) -> torch.Tensor:
        return self._probs[buffer]

    def publish(self, buffer: int) -> None:
        """Record this buffer's event on the stream that wrote it: the target waits on it."""
        self._events[buffer].record(torch.cuda.current_stream(self.device))

    def receive(self, buffer: int, rows: int, with_probs: bool,
                device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Wait for the draft's writes (its event), then copy the rows to ``device``: a device to
        host copy for a host reader, a peer copy for another GPU, a device copy on the same GPU.
        Always a copy, finished before returning, so the draft may reuse the buffer as soon as
        the target's next request reaches it."""
        device = torch.device(device)
        self._events[buffer].synchronize()
        tokens = self._tokens[buffer, :rows].to(device, copy=True)
        probs = self._probs[buffer, :rows].to(device, copy=True) if with_probs else None
        torch.cuda.synchronize(self.device)  # the copies are done reading the mapped buffer
        if device.type == "cuda" and device != self.device:
            torch.cuda.synchronize(device)
        return tokens, probs

    def close(self) -> None:
        """Drop the mapping (target) or the allocation (draft); torch's IPC reference counting
        keeps the memory until both sides have let go."""
        self._tokens = self._probs = None
        self._events = []
