"""The engine options of a Triton model repository: ``1/model.json``, written by `trtssd triton-repo`
and read when the model loads (as vLLM's Triton backend keeps its engine arguments in a
``model.json`` next to ``model.py``). Edit it to change the engine without regenerating.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trtssd.serving.async_llm import DEFAULT_MAX_WAITING

OPTIONS_FILE = "model.json"


@dataclass(frozen=True)
class ModelOptions:
    engine: str  # engine directory (absolute)
    # Keyword options of trtssd.LLM (mode, k, max_batch, ...). tensor_parallel_size T > 1: the model
    # instance is the target's rank 0 and starts ranks 1..T-1 itself (trtssd/backends/tensor_parallel.py).
    llm: dict = field(default_factory=dict)
    max_waiting: int = DEFAULT_MAX_WAITING  # requests queued beyond max_batch before new ones are refused
    log_level: str = "WARNING"  # the model's Python logging level (in tritonserver's output)

    def write(self, version_dir: Path) -> Path:
        path = version_dir / OPTIONS_FILE
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def read(cls, version_dir: Path) -> "ModelOptions":
        path = version_dir / OPTIONS_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read the model's options {path}: {err}") from None
        known = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or not set(data) <= known or "engine" not in data:
            raise ValueError(f"{path} must be a JSON object with 'engine' and optionally {sorted(known - {'engine'})}; "
                             f"got keys {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        return cls(**data)
