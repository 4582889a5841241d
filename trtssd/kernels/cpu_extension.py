"""The project's compiled CPU code: one torch C++ extension holding the draft's fused layers
(``draft_layers.cpp``) and its few-row int4 matmul (``int4_matmul.cpp``).

It is compiled on first use with torch's C++ extension builder (ninja + the system C++ compiler,
~1 minute, ``-march=native``: the AVX2 integer paths need it, and a CPU without AVX2 gets the
portable loops of the same arithmetic) and cached under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), keyed by the sources' contents.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "draft_layers.cpp", HERE / "int4_matmul.cpp")


@functools.lru_cache(maxsize=1)
def load_extension():
    """Compile (once per machine, cached by torch) and import the C++ extension."""
    from torch.utils.cpp_extension import load

    with _interpreter_bin_first_on_path():
        return load(
            name="trtssd_draft_layers",
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            extra_include_paths=[str(HERE)],
            verbose=False,
        )


@contextlib.contextmanager
def _interpreter_bin_first_on_path():
    """Always build with the ninja installed next to this interpreter (our dependency): two
    ninja versions read each other's build log as stale, so a system ninja on PATH in some
    processes and ours in others made every load recompile (35-150 s)."""
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{old}"
    try:
        yield
    finally:
        os.environ["PATH"] = old
