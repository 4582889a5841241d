"""Which models an `LLM` loads: explicit model references, an engine directory (what `trtssd
build` writes: target, draft and manifest), or the default engine, built on first use.

Only the last imports the engine builder (trtssd/build.py): serving an engine directory or
explicit models never loads it.
"""

from __future__ import annotations

from trtssd.config import ModelRef
from trtssd.models.engine_dir import is_engine_dir


def resolve_models(engine: str | None, target: ModelRef | None, draft: ModelRef | None) -> tuple[ModelRef, ModelRef]:
    """The (target, draft) pair to load: explicit refs, an engine directory, or the default."""
    if target is not None:
        if engine is not None:
            raise ValueError("give either engine or target/draft, not both")
        return target, draft if draft is not None else target
    if draft is not None:
        raise ValueError("a draft ModelRef needs a target ModelRef too")
    if engine is None:
        from trtssd.build import default_engine  # builds it on first use

        engine = str(default_engine())
    if not is_engine_dir(engine):
        raise ValueError(f"engine {engine!r} is not an engine directory (no manifest.json); build one with `trtssd build`")
    return ModelRef(engine, "target"), ModelRef(engine, "draft")
