"""trtssd: speculative speculative decoding (Saguaro) with target and draft in separate ranks."""

from trtssd.config import Backup, Mode, ModelRef, RuntimeConfig, SpeculativeConfig
from trtssd.sampling import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in MPI and the model code; import it only when asked for.
    if name in ("LLM", "RequestOutput"):
        from trtssd import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'trtssd' has no attribute {name!r}")


__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpeculativeConfig", "RuntimeConfig", "ModelRef", "Mode", "Backup"]
