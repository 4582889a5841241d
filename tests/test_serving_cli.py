"""`trtssd serve`: its own flags (the engine options of every command: tests/test_cli_options.py);
the real command on a socket until SIGTERM, which ends its draft rank too (tiny models, to start
quickly)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tiny_models import make_tiny_llama
from trtssd import cli
from trtssd.processes import descendants, start_time


def test_serve_has_its_server_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--host", "--port", "--engine", "--target", "--draft", "--api-key", "--served-model-name",
                 "--max-waiting", "--launch"):
        assert flag in text


@pytest.mark.slow
@pytest.mark.mpi
def test_trtssd_serve_answers_on_its_port_and_sigterm_ends_it_and_its_draft(tmp_path):
    target = make_tiny_llama(tmp_path / "target", seed=0)
    draft = make_tiny_llama(tmp_path / "draft", seed=1, base=target, noise=0.05)
    cmd = [sys.executable, "-m", "trtssd.cli", "serve", "--port", "0", "--target", str(target), "--draft", str(draft),
           "--mode", "ssd", "--max-model-len", "128", "--served-model-name", "tiny", "--api-key", "secret"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = _wait_for_url(proc, timeout_s=120)
        assert httpx.get(url + "/health").json() == {"status": "ok", "mode": "ssd", "draft": "alive"}
        auth = {"Authorization": "Bearer secret"}
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 9,
                                                      "temperature": 0}, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 9
        assert httpx.post(url + "/v1/completions", json={"prompt": [1]}).status_code == 401
        draft_job = [pid for pid in descendants(proc.pid) if _is_draft_job(pid)]
        assert len(draft_job) >= 2  # mpiexec, its proxy and the draft rank
        proc.send_signal(signal.SIGTERM)  # what a container runtime sends
        assert proc.wait(timeout=60) == 0
        assert not [pid for pid in draft_job if start_time(pid) is not None]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _is_draft_job(pid: int) -> bool:
    """mpiexec, hydra's proxy or the draft rank (not, e.g., a resource tracker that exits after
    its parent)."""
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return any(name in cmdline for name in ("mpiexec", "hydra_pmi_proxy", "trtssd.runtime.draft_rank"))


def _wait_for_url(proc: subprocess.Popen, timeout_s: float) -> str:
    """The address `trtssd serve` logs once it listens (the rest of its log is drained, so a
    full pipe never blocks it)."""
    deadline = time.monotonic() + timeout_s
    for line in proc.stderr:
        found = re.search(r"serving tiny on (http://\S+)", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return found.group(1)
        assert time.monotonic() < deadline, "trtssd serve did not start in time"
    raise AssertionError(f"trtssd serve exited with {proc.wait()} before listening")
