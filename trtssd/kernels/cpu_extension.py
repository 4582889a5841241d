"""The project's compiled CPU code: one torch C++ extension holding the draft's fused layers
(``draft_layers.cpp``) and its few-row int4 matmul (``int4_matmul.cpp``, ``int4_matmul.h``).

It is compiled with torch's C++ extension builder (ninja + the system C++ compiler, ~1 minute,
``-march=native``: the AVX2 integer paths need it, and a CPU without AVX2 gets the portable loops
of the same arithmetic) by ``trtssd build`` or else on first use, and cached under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/py<ver>_cpu``).

Two things torch's builder does not do, and this module does:

- Key the build by what it is built from. torch keys its build directory by the extension's
  name only, so two checkouts or installs (different source paths, different torch) rewrote each
  other's build.ninja and recompiled every time (~56 s). Here the name carries a hash of the
  sources, torch, Python and the flags, and the sources are copied into the build directory, so
  every build command sees the same paths and different inputs never share a directory.
- Never wait forever. torch's lock is a file created and removed by the builder (its "baton"):
  a process killed mid-build leaves it behind and every later start waits on it, forever. Here
  each build first takes an ``flock`` on a file of our own, which the kernel releases when its
  holder dies, with a deadline; whoever holds it may remove a baton left behind (no one else can
  be building), and a deadline passed is an error naming the lock file.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
NAME = "trtssd_draft_layers"
SOURCES = (HERE / "draft_layers.cpp", HERE / "int4_matmul.cpp")
HEADERS = (HERE / "int4_matmul.h",)
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd")
LOCK_FILE = "trtssd-build.lock"  # ours (flock); torch's baton is "lock" in the same directory
# Another process compiling takes ~1 minute on two cores; one holding the lock far longer is stuck.
LOCK_TIMEOUT_ENV = "TRTSSD_BUILD_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 300.0


class BuildLockTimeout(RuntimeError):
    """Another process held the build lock past the deadline."""


@functools.lru_cache(maxsize=1)
def load_extension():
    """Compile (once per machine and set of inputs) and import the C++ extension."""
    return build_and_load(SOURCES, HEADERS, CFLAGS, lock_timeout_s=_lock_timeout_s())


def build_and_load(sources, headers, cflags, lock_timeout_s: float, name: str = NAME):
    """Build ``sources`` (which may include ``headers``) in a directory keyed by their hash and
    import the module; raises BuildLockTimeout when another build holds the lock too long."""
    from torch.utils.cpp_extension import load

    key = build_key(sources, headers, cflags)
    directory = build_directory(f"{name}_{key}")
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with build_lock(directory / LOCK_FILE, lock_timeout_s):
        _remove_stale_baton(directory / "lock")
        copies = _copy_sources(directory / "src", [*sources, *headers])
        with _interpreter_bin_first_on_path():
            module = load(
                name=directory.name,
                sources=[str(copies / Path(s).name) for s in sources],
                extra_cflags=list(cflags),
                extra_include_paths=[str(copies)],
                build_directory=str(directory),
                verbose=False,
            )
    log.info("compiled draft layers loaded from %s (%.1f s)", directory, time.perf_counter() - start)
    return module


def build_key(sources, headers, cflags) -> str:
    """A hash of everything a build depends on: the sources' contents, torch (version and where
    it is installed: the build links against it), Python and the compiler flags."""
    import torch

    digest = hashlib.sha256()
    for path in [*sources, *headers]:
        digest.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    for part in (torch.__version__, str(Path(torch.__file__).parent), sys.version, os.environ.get("CXX", ""),
                 *cflags):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def build_directory(name: str) -> Path:
    """Where torch's builder would put extension ``name`` (so the cache stays where users expect)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:  # torch's default root has a folder per Python and accelerator
        root = Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    return Path(root) / name


@contextlib.contextmanager
def build_lock(path: Path, timeout_s: float, poll_s: float = 0.2):
    """Hold an exclusive flock on ``path``; BuildLockTimeout after ``timeout_s`` without it. The
    kernel drops an flock when its holder exits, however it exits, so none is ever stale."""
    with open(path, "a+") as handle:
        deadline = time.monotonic() + timeout_s
        waiting = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BuildLockTimeout(
                        f"another process held the draft layers' build lock {path} for over {timeout_s:.0f} s; "
                        f"if no trtssd build is running, remove {path.parent} and retry (or raise "
                        f"{LOCK_TIMEOUT_ENV})") from None
                if not waiting:
                    log.info("waiting for another process compiling the draft layers (lock %s)", path)
                    waiting = True
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_baton(baton: Path) -> None:
    """Called with the build lock held, so no process of ours is building: a baton left here is
    from a build killed before torch could remove it, and torch would wait on it forever."""
    if baton.exists():
        log.warning("removing %s, left by a draft-layers build that did not finish", baton)
        baton.unlink(missing_ok=True)


def _copy_sources(folder: Path, files) -> Path:
    """Copy the sources into the build directory once (same paths in every build command, so
    ninja never sees a changed command; never rewritten, so their times never trigger a rebuild).
    The directory is keyed by their contents, so a copy present is the right one."""
    folder.mkdir(exist_ok=True)
    for path in files:
        target = folder / Path(path).name
        if not target.exists():
            partial = target.with_suffix(target.suffix + ".partial")
            shutil.copyfile(path, partial)
            os.replace(partial, target)
    return folder


def _lock_timeout_s() -> float:
    value = os.environ.get(LOCK_TIMEOUT_ENV)
    return DEFAULT_LOCK_TIMEOUT_S if value is None else float(value)


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
