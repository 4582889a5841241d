"""Whether TensorRT-LLM can be used here, and the one place that imports it.

Every use of ``tensorrt_llm`` goes through :func:`import_tensorrt_llm`, so the package is only
imported when a TensorRT-LLM feature is actually used, and its absence is reported the same way
everywhere (what is missing, which Python looked for it, where to get it).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

PACKAGE = "tensorrt_llm"
# The last TensorRT-LLM release with compiled engines and the engine Executor; also what the
# Triton 25.12 TRT-LLM container ships.
RELEASE = "1.2.x"
CONTAINER = "nvcr.io/nvidia/tensorrt-llm/release:1.2.1"


class TensorRTLLMMissing(RuntimeError):
    """``tensorrt_llm`` cannot be imported in this Python."""


def tensorrt_llm_available() -> bool:
    """True when ``import tensorrt_llm`` would find the package (it is not imported here)."""
    return importlib.util.find_spec(PACKAGE) is not None


def missing_message(needed_for: str) -> str:
    return (f"{needed_for} needs the Python package `{PACKAGE}` (TensorRT-LLM {RELEASE}), which is not "
            f"importable from {sys.executable}. Use a machine or container where it is installed, "
            f"e.g. {CONTAINER}.")


def import_tensorrt_llm(module: str = PACKAGE, needed_for: str = "this feature") -> ModuleType:
    """Import ``module`` (``tensorrt_llm`` or one of its submodules) on first use.

    unverified: never run (TensorRT-LLM cannot be installed where trtssd is developed).
    Raises TensorRTLLMMissing, naming what needed it, when the package is absent.
    """
    if not tensorrt_llm_available():
        raise TensorRTLLMMissing(missing_message(needed_for))
    return importlib.import_module(module)
