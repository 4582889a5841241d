"""llama.cpp's llama-server as a bench peer, on the embedded SmolLM2 GGUF."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from trtssd.bench.config import BenchConfig
from trtssd.bench.llamacpp import LlamaServer, ServerOptions, ensure_llama_server
from trtssd.bench.sweep import run_benchmark


@pytest.fixture(scope="module")
def server_bin() -> Path:
    """llama-server, built by scripts/setup_llamacpp.sh tools the first time a test needs it."""
    return ensure_llama_server()


@pytest.fixture(scope="module")
def gguf() -> Path:
    from trtssd.models.smollm2 import ensure_smollm2_gguf

    return ensure_smollm2_gguf()


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_server_starts_answers_and_stops(server_bin, gguf):
    with LlamaServer(ServerOptions(model=gguf, ctx_per_slot=256), server_bin) as server:
        pid = server.pid
        reply = server.completion({"prompt": [1, 2, 3], "n_predict": 4, "temperature": 0,
                                   "return_tokens": True, "cache_prompt": False})
        assert len(reply["tokens"]) == 4
    assert _gone(pid)


def test_server_is_gone_after_an_error_inside(server_bin, gguf):
    with pytest.raises(RuntimeError, match="boom"):
        with LlamaServer(ServerOptions(model=gguf, ctx_per_slot=256), server_bin) as server:
            pid = server.pid
            raise RuntimeError("boom")
    assert _gone(pid)


def test_llamacpp_systems_greedy_equal(server_bin, gguf, tmp_path):
    cfg = BenchConfig(target=str(gguf), systems=("llama.cpp", "llama.cpp-sd"), datasets=("chat",),
                      prompts_per_set=2, max_tokens=8, ks=(3,), budgets=(1,), calibrate=False, plots=False,
                      out_dir=tmp_path)
    report = run_benchmark(cfg, "test")
    runs = {r.key.system: r for r in report.runs}
    assert set(runs) == {"llama.cpp", "llama.cpp-sd"}
    for run in runs.values():
        assert run.error is None, run.error
        assert len(run.requests) == 2 and all(len(r.output_ids) == 8 for r in run.requests)
        assert run.summary["tokens_per_s"] > 0
    # A draft must not change greedy output.
    assert [r.output_ids for r in runs["llama.cpp"].requests] == [r.output_ids for r in runs["llama.cpp-sd"].requests]
    assert not [p for p in psutil.Process().children(recursive=True) if "llama-server" in p.name()]
