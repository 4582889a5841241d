"""Device names from the configuration made into torch devices, with CUDA's presence checked.

`trtssd.config.check_device` checks a name's form when a configuration is made; whether the
device exists is only known where it is used (each rank, each loader), so it is asked here.
"""

from __future__ import annotations

import torch

from trtssd.config import check_device


def resolve_device(name: str | torch.device, field_name: str = "device") -> torch.device:
    """The torch device for ``name`` ("cpu", "cuda", "cuda:N"); a clear error naming
    ``field_name`` when CUDA is asked for and this machine's torch has none, or too few GPUs."""
    name = check_device(str(name), field_name)
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"{field_name} is {name!r} but CUDA is not available here (torch {torch.__version__}, "
                         f"torch.cuda.is_available() is False); use {field_name}='cpu'")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"{field_name} is {name!r} but this machine has {count} CUDA device(s): "
                         f"use 'cuda:0' .. 'cuda:{count - 1}'")
    if device.index is None:  # "cuda" means the current device: pin it, so both sides agree on which
        device = torch.device("cuda", torch.cuda.current_device())
    return device
