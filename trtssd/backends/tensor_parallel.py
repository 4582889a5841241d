"""A tensor-parallel torch target: one ``TorchExecutor`` per rank over that rank's model shard.

The split itself (which rows and columns each rank holds, the collectives) is
``trtssd.models.tensor_parallel``. The executor needs nothing new: it is the ordinary
``TorchExecutor`` of the shard, so its KV pool is sized from the shard's local config (each rank
caches only its own KV heads), and its sequence bookkeeping (add_sequence, commit, release,
copy_slots) is rank-local and identical on every rank because every rank sees the same calls.

The contract: every rank calls the same executor methods with the same arguments in the same
order (a forward on one rank waits in its first all-reduce for the others). The runtime keeps it
with rank 0's ``TensorParallelExecutor`` (trtssd/runtime/tensor_parallel.py), which sends each
call to the follower ranks; ``broadcast_chunks`` sends one forward's chunks alone (tests).
Every rank's ``forward`` returns the full logits.

Process groups: gloo on CPU; NCCL with one CUDA device per rank (written, not run yet: each rank
gets its own ``device`` and calls ``torch.cuda.set_device`` before the first collective, as
``trtssd.runtime.tensor_parallel.join_group`` does).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from trtssd.backends.base import Chunk, chunk_on_host
from trtssd.backends.torch_backend import SUPPORTED_DTYPES, TorchExecutor
from trtssd.models.config import ModelConfig
from trtssd.models.loader import gguf_config, is_gguf, load_config, load_state_dict, read_gguf
from trtssd.models.tensor_parallel import check_tensor_parallel, tensor_parallel_model

log = logging.getLogger(__name__)


def tensor_parallel_executor(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    rank: int,
    size: int,
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **executor_options: Any,
) -> TorchExecutor:
    """Rank ``rank``'s executor of a ``size``-way split of the model (``cfg``, full fp32 ``state``
    in ``LlamaModel``'s layout). ``executor_options``: ``TorchExecutor``'s (max_seqs,
    max_seq_len, max_batch_tokens, memory_budget_bytes, ...), the same on every rank."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    model = tensor_parallel_model(cfg, state, rank, size, group=group, dtype=dtype, device=device)
    return TorchExecutor(model, **executor_options)


def load_tensor_parallel_executor(
    path: str | Path, rank: int, size: int, **options: Any
) -> TorchExecutor:
    """``tensor_parallel_executor`` from a Hugging Face directory or GGUF file. Every rank reads the
    whole checkpoint (fp32) and keeps its slices; the size is checked before any weight is read."""
    cfg = gguf_config(read_gguf(path)) if is_gguf(path) else load_config(path)
    check_tensor_parallel(cfg, size)
    cfg, state = load_state_dict(path)
    return tensor_parallel_executor(cfg, state, rank, size, **options)


def broadcast_chunks(
    chunks: Sequence[Chunk] | None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> list[Chunk]:
    """One forward's chunks from rank ``src`` (a global rank) to every rank of ``group``; returns
    them on every rank, tensors on the host (``src`` too). Other ranks pass None.

    The chunks travel pickled (``broadcast_object_list``): a few small int tensors per forward,
    where one message is simpler than a tensor per field, and new ``Chunk`` fields travel with no
    change here. Tensors are sent from the host so any rank can unpickle them. ``device``: the
    CUDA device of this rank under NCCL (the pickled bytes are staged there); None under gloo.
    """
    if dist.get_rank() == src:
        if chunks is None:
            raise ValueError("the source rank must pass the chunks")
        payload = [[chunk_on_host(c) for c in chunks]]
    else:
        payload = [None]
    dist.broadcast_object_list(payload, src=src, group=group, device=device)
    return list(payload[0])
