"""trtssd: speculative speculative decoding (Saguaro) with target and draft in separate ranks."""

import importlib.metadata

from trtssd.config import Backup, Mode, ModelRef, RuntimeConfig, SpeculativeConfig
from trtssd.sampling import SamplingParams
from trtssd.structured.constraint import Constraint


def __getattr__(name: str):
    if name == "__version__":  # pyproject.toml's, as installed: one place to bump
        try:
            return importlib.metadata.version("trtssd")
        except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
            return "unknown (not installed)"
    # LLM pulls in MPI and the model code; import it only when asked for.
    if name in ("LLM", "RequestOutput"):
        from trtssd import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'trtssd' has no attribute {name!r}")


__all__ = ["LLM", "RequestOutput", "SamplingParams", "Constraint", "SpeculativeConfig", "RuntimeConfig", "ModelRef", "Mode", "Backup"]
