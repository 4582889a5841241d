"""`trtssd bench prefill` against a real server on a socket: both scenarios run, every request
completes, and the result files say what was measured."""

from __future__ import annotations

import json

import pytest

from trtssd import LLM
from trtssd.bench import prefill_load
from trtssd.serving.openai_server import OpenAIServer
from trtssd.serving.uvicorn_runner import BackgroundServer

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def url():
    with LLM(mode="ssd", launch="local", max_batch=3, max_model_len=1024, fanout=(2, 1, 1, 1, 1, 1)) as llm:
        with BackgroundServer(OpenAIServer(llm, "smol")) as bg:
            yield bg.url


def test_turns_scenario_writes_ttft_by_turn(url, tmp_path):
    argv = ["--scenario", "turns", "--base-url", url, "--out", str(tmp_path), "--sessions", "2", "--turns", "3",
            "--system-words", "120", "--max-tokens", "4"]
    assert prefill_load.main(argv, "test") == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert list(result["summary"]["ttft_by_kind"]) == ["turn 1", "turn 2", "turn 3"]
    assert all(s["n"] == 2 for s in result["summary"]["ttft_by_kind"].values())
    assert "| turn 3 | 2 |" in (tmp_path / "result.md").read_text()


def test_arrivals_scenario_measures_short_streams_beside_long_prompts(url, tmp_path):
    argv = ["--scenario", "arrivals", "--base-url", url, "--out", str(tmp_path), "--concurrency", "2",
            "--duration-s", "6", "--long-every-s", "2", "--long-words", "300", "--max-tokens", "6"]
    assert prefill_load.main(argv, "test") == 0
    summary = json.loads((tmp_path / "result.json").read_text())["summary"]
    assert summary["errors"] == [] and summary["ttft_by_kind"]["long"]["n"] >= 1
    short = summary["itl_by_kind"]["short"]
    assert short["n"] > 0 and short["p50_ms"] <= short["p99_ms"] <= short["max_ms"]
