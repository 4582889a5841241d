"""The llama.cpp build folder's name: Python and scripts/setup_llamacpp.sh must agree on it, or a
benchmark would look for llama-server where the set-up did not put it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from trtssd.bench.llamacpp import LLAMACPP_VERSION, SETUP_SCRIPT, cpu_key, default_bin_dir


def _bash_function(name: str) -> str:
    """The text of one bash function of setup_llamacpp.sh (from ``name() {`` to its closing brace)."""
    text = SETUP_SCRIPT.read_text()
    match = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", text, re.S | re.M)
    assert match, f"{name}() not found in {SETUP_SCRIPT}"
    return match.group(0)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="no /proc/cpuinfo")
def test_cpu_key_equals_the_scripts():
    script = _bash_function("cpu_key") + "cpu_key\n"
    bash_key = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert cpu_key() == bash_key


def test_cpu_key_sorts_flags_and_ignores_spacing():
    one = "processor\t: 0\nflags\t\t: sse2 avx  fpu\nflags\t\t: other\n"
    two = "flags\t: fpu avx sse2\n"
    assert cpu_key(one) == cpu_key(two)
    assert re.fullmatch(r"[0-9a-f]{12}", cpu_key(one))


def test_version_and_folder_match_the_script():
    assert f"VERSION={LLAMACPP_VERSION} " in SETUP_SCRIPT.read_text()
    assert default_bin_dir().parent.name.startswith(f"{LLAMACPP_VERSION}-")
    assert default_bin_dir().parent.name.endswith(f"-{cpu_key()}")
