"""The compiled draft layers' build (trtssd.kernels.cpu_extension): keyed by what it is built from,
and never able to hang a start on a lock left by a killed build."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trtssd.kernels import cpu_extension as ce


def _sources(tmp_path: Path, body: str) -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "a.h").write_text("#pragma once\n")
    (tmp_path / "a.cpp").write_text(body)
    return tmp_path / "a.cpp", tmp_path / "a.h"


def test_different_sources_use_different_build_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    one = _sources(tmp_path / "one", "int f() { return 1; }\n")
    same = _sources(tmp_path / "same", "int f() { return 1; }\n")  # another checkout, same contents
    two = _sources(tmp_path / "two", "int f() { return 2; }\n")
    key = ce.build_key([one[0]], [one[1]], ce.CFLAGS)
    assert key == ce.build_key([same[0]], [same[1]], ce.CFLAGS)  # paths do not matter
    assert key != ce.build_key([two[0]], [two[1]], ce.CFLAGS)
    assert key != ce.build_key([one[0]], [one[1]], ("-O2",))
    (tmp_path / "one" / "a.h").write_text("#pragma once\n#define X 1\n")  # a header is an input too
    assert key != ce.build_key([one[0]], [one[1]], ce.CFLAGS)
    assert ce.build_directory(f"x_{key}") == tmp_path / "ext" / f"x_{key}"


def test_the_shipped_sources_include_the_header():
    """Both .cpp files include int4_matmul.h: the key and the copies must cover it."""
    for source in ce.SOURCES:
        assert '#include "int4_matmul.h"' in source.read_text()
    assert [h.name for h in ce.HEADERS] == ["int4_matmul.h"] and ce.HEADERS[0].exists()


def test_a_held_lock_times_out_naming_the_file(tmp_path):
    path = tmp_path / ce.LOCK_FILE
    with open(path, "a+") as holder:  # another open file: flock conflicts even within one process
        fcntl.flock(holder, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(ce.BuildLockTimeout, match=str(path)):
            with ce.build_lock(path, timeout_s=0.3, poll_s=0.05):
                pass
        assert time.monotonic() - start < 5
    with ce.build_lock(path, timeout_s=0.3):  # released: free at once
        pass


def test_the_lock_of_a_killed_build_is_free(tmp_path):
    """A build killed while holding the lock (the case that hung starts forever) frees it."""
    path = tmp_path / ce.LOCK_FILE
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(path)!r}, "a+")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ce.BuildLockTimeout):
            with ce.build_lock(path, timeout_s=0.2, poll_s=0.05):
                pass
    finally:
        holder.kill()
        holder.wait()
    with ce.build_lock(path, timeout_s=2):
        pass


def test_a_stale_torch_baton_is_removed_not_waited_on(tmp_path, monkeypatch):
    """torch's own lock ("lock", created and deleted by its builder) outlives a killed build; with
    our lock held it can only be stale, so it is removed before torch looks for it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source, header = _sources(tmp_path / "src", '#include "a.h"\nint f() { return 1; }\n')
    directory = ce.build_directory(f"t_{ce.build_key([source], [header], ce.CFLAGS)}")
    directory.mkdir(parents=True)
    (directory / "lock").touch()
    seen = {}

    def fake_load(name, sources, extra_include_paths, build_directory, **_):
        from torch.utils.file_baton import FileBaton

        if not FileBaton(str(Path(build_directory) / "lock")).try_acquire():
            raise AssertionError("torch would wait on the baton forever")
        seen.update(name=name, sources=sources, include=extra_include_paths)
        return "module"

    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load)
    assert ce.build_and_load([source], [header], ce.CFLAGS, lock_timeout_s=1, name="t") == "module"
    assert seen["name"] == directory.name
    # compiled from copies inside the build directory, the header next to them
    assert seen["sources"] == [str(directory / "src" / "a.cpp")]
    assert (Path(seen["include"][0]) / "a.h").exists()


@pytest.mark.slow
def test_a_real_build_survives_a_stale_baton(tmp_path):
    """torch's builder itself, on a tiny extension: a baton left in the build directory does not
    stop the build (run in a subprocess with a deadline, so a regression fails, never hangs)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.h").write_text("#pragma once\ninline int answer() { return 42; }\n")
    (src / "tiny.cpp").write_text(
        '#include <torch/extension.h>\n#include "tiny.h"\n'
        "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"answer\", &answer); }\n")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from trtssd.kernels import cpu_extension as ce
        sources, headers = [Path({str(src / 'tiny.cpp')!r})], [Path({str(src / 'tiny.h')!r})]
        d = ce.build_directory("tiny_" + ce.build_key(sources, headers, ("-O0",)))
        d.mkdir(parents=True)
        (d / "lock").touch()
        print(ce.build_and_load(sources, headers, ("-O0",), lock_timeout_s=5, name="tiny").answer())
    """)
    env = {**__import__("os").environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("42")
