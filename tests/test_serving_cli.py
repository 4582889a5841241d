"""`trtssd serve`, `generate` and `triton-repo`: a flag for every LLM option; the real `serve`
command on a socket until SIGTERM, which ends its draft rank too (tiny models, to start quickly)."""

from __future__ import annotations

import dataclasses
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
from trtssd.config import RuntimeConfig, SpeculativeConfig
from trtssd.runtime.processes import descendants, start_time


def _parse(argv: list[str]):
    parser = cli.build_parser()
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize("command", ["serve", "generate", "triton-repo"])
def test_each_command_that_starts_an_llm_has_a_flag_for_every_llm_option(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = capsys.readouterr().out
    fields = [f.name for cls in (SpeculativeConfig, RuntimeConfig) for f in dataclasses.fields(cls)]
    missing = [name for name in fields if f"--{name.replace('_', '-')}" not in text]
    assert not missing, f"trtssd {command} lacks flags for LLM options {missing}"


def test_serve_has_its_server_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--host", "--port", "--engine", "--target", "--draft", "--api-key", "--served-model-name",
                 "--max-waiting", "--launch"):
        assert flag in text


def test_serve_flags_become_valid_llm_options():
    args = _parse(["--mode", "sd", "--k", "3", "--fanout", "1,2,1,1", "--backup", "fast", "--max-batch", "2",
                   "--target-cores", "0", "--no-plain-under-load", "--draft-timeout-s", "5"])
    options = cli._llm_options(args)
    assert options == {"mode": "sd", "k": 3, "fanout": (1, 2, 1, 1), "backup": "fast", "max_batch": 2,
                       "target_cores": (0,), "plain_under_load": False, "draft_timeout_s": 5.0}
    spec = {k: v for k, v in options.items() if k in SpeculativeConfig.__dataclass_fields__}
    SpeculativeConfig(**spec)
    RuntimeConfig(**{k: v for k, v in options.items() if k not in spec})
    assert cli._llm_options(_parse([])) == {}  # unset flags keep LLM's defaults
    with pytest.raises(ValueError, match="--fanout must be comma-separated integers"):
        cli._llm_options(_parse(["--fanout", "1,x"]))


@pytest.mark.slow
@pytest.mark.mpi
def test_trtssd_serve_answers_on_its_port_and_sigterm_ends_it_and_its_draft(tmp_path):
    target = make_tiny_llama(tmp_path / "target", seed=0)
    draft = make_tiny_llama(tmp_path / "draft", seed=1, base=target, noise=0.05)
    cmd = [sys.executable, "-m", "trtssd.cli", "serve", "--port", "0", "--target", str(target), "--draft", str(draft),
           "--mode", "ssd", "--max-seq-len", "128", "--served-model-name", "tiny", "--api-key", "secret"]
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
