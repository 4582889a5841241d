"""`trtssd bench serve` against a stand-in OpenAI-compatible server whose timings are known.

The stand-in (aiohttp, 127.0.0.1, ephemeral port, in a thread of this process) sleeps known amounts
before the first chunk and between chunks, sends several tokens per chunk as a speculative server
does, reports usage in a final chunk, and exposes vLLM's spec-decode counters and trtssd's cache
counters on /metrics. So TTFT, ITL, TPOT, E2E, throughput, acceptance length and hit rate all have
known answers, checked within a tolerance wide enough for a shared 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from trtssd.bench.serve import (  # noqa: E402
    Load,
    RequestResult,
    ServeConfig,
    SSEDecoder,
    arrival_offsets,
    parse_prometheus,
    run_serve_benchmark,
    server_counters,
    spec_summary,
    summarize_run,
)
from trtssd.bench.serve_report import write_report  # noqa: E402

# --- the stand-in server -------------------------------------------------------------------------


@dataclass
class Script:
    """How the stand-in answers every request."""

    ttft_s: float = 0.10
    gap_s: float = 0.04
    chunks: int = 5
    tokens_per_chunk: int = 3  # usage says chunks * tokens_per_chunk tokens: counting chunks would be wrong
    prompt_tokens: int = 7
    metrics: bool = True
    silent_first: bool = False  # the first token chunk has no text (a special token)


# Per served request: 5 drafts of 4 tokens, accepted 4, 3, 2, 1 at positions 0..3 (10 in all), 3 hits, 1 miss.
DRAFTS, DRAFT_TOKENS, ACCEPTED_PER_POS, HITS, MISSES = 5, 20, (4, 3, 2, 1), 3, 1


def metrics_text(served: int) -> str:
    labels = 'engine="0",model_name="standin"'
    lines = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
             "# TYPE vllm:spec_decode_num_drafts_total counter",
             f"vllm:spec_decode_num_drafts_total{{{labels}}} {DRAFTS * served}.0",
             f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7e+09",
             f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {DRAFT_TOKENS * served}.0",
             f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {sum(ACCEPTED_PER_POS) * served}.0"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {n * served}.0'
              for i, n in enumerate(ACCEPTED_PER_POS)]
    lines += [f"trtssd:spec_decode_cache_hits_total {HITS * served}.0",  # trtssd serve's names
              f"trtssd:spec_decode_cache_misses_total {MISSES * served}.0",
              "trtssd:cache_hit_rate 0.123",  # a gauge with a similar name must not be read as the counter
              f'vllm:prefix_cache_hits_total{{{labels}}} 999.0',  # another cache altogether
              f"trtssd:draft_prefix_cache_hits_total {999 * served}.0"]  # sorts first, and is not it either
    return "\n".join(lines) + "\n"


@dataclass
class StandIn:
    script: Script = field(default_factory=Script)
    bodies: list = field(default_factory=list)
    served: int = 0
    in_flight: int = 0
    max_in_flight: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v2/models/{model}/generate_stream", self.generate_stream)
        if self.script.metrics:
            app.router.add_get("/metrics", self.metrics)
        return app

    async def generate_stream(self, request):
        """Triton's generate extension over the trtssd model: one event per round with the new text
        and the running token count, a last event with the finish reason; the stream then closes."""
        body = await request.json()
        self.bodies.append({**body, "model": request.match_info["model"]})
        s = self.script
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(s.ttft_s)
        for i in range(s.chunks):
            if i:
                await asyncio.sleep(s.gap_s)
            await self._send(resp, {"model_name": "trtssd", "text_output": "tok " * s.tokens_per_chunk,
                                    "num_input_tokens": [s.prompt_tokens],
                                    "num_output_tokens": [(i + 1) * s.tokens_per_chunk], "finish_reason": ""})
        await self._send(resp, {"model_name": "trtssd", "text_output": "", "num_input_tokens": s.prompt_tokens,
                                "num_output_tokens": s.chunks * s.tokens_per_chunk, "finish_reason": "length"})
        self.served += 1
        return resp

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "standin", "object": "model"}]})

    async def metrics(self, request):
        return web.Response(text=metrics_text(self.served), content_type="text/plain")

    async def completions(self, request):
        return await self.stream(request, chat=False)

    async def chat(self, request):
        return await self.stream(request, chat=True)

    async def stream(self, request, chat: bool):
        body = await request.json()
        self.bodies.append(body)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return web.json_response({"error": {"message": "stand-in refuses", "type": "InternalServerError",
                                                "param": None, "code": 500}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, chat, "DROP" in prompt)
        finally:
            self.in_flight -= 1

    async def _stream(self, request, chat: bool, drop: bool):
        s = self.script
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:  # the role-only opening delta comes at once and is not a token
            await self._send(resp, self._chunk(chat, "", role=True))
        await asyncio.sleep(s.ttft_s)
        for i in range(s.chunks):
            if i:
                await asyncio.sleep(s.gap_s)
            text = "" if s.silent_first and i == 0 else "tok " * s.tokens_per_chunk
            await self._send(resp, self._chunk(chat, text, token=True))
            if drop:  # the connection dies mid-stream
                request.transport.close()
                return resp
        await self._send(resp, self._chunk(chat, "", finish="length"))
        tokens = s.chunks * s.tokens_per_chunk
        await self._send(resp, {"choices": [], "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": tokens,
                                                         "total_tokens": s.prompt_tokens + tokens}})
        await resp.write(b"data: [DONE]\n\n")
        self.served += 1
        return resp

    @staticmethod
    def _chunk(chat: bool, text: str, role: bool = False, finish: str | None = None, token: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text or token else {})
            return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                                    "finish_reason": finish}]}
        return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    @staticmethod
    async def _send(resp, event: dict) -> None:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())


@contextlib.contextmanager
def serving(stand_in: StandIn):
    """Runs the stand-in on its own event loop in a thread, so the client's work cannot delay its sleeps."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(stand_in.app(), access_log=None)

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def prompts_file(tmp_path, prompts: list[str]):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return str(path)


def config(tmp_path, base_url: str, prompts: list[str], **kw) -> ServeConfig:
    kw.setdefault("out_dir", tmp_path / "out")
    return ServeConfig(base_url=base_url, datasets=(prompts_file(tmp_path, prompts),), num_prompts=len(prompts),
                       max_tokens=15, **kw)


# --- pieces with exact answers -------------------------------------------------------------------


def test_sse_decoder_joins_events_split_anywhere():
    stream = ('data: {"a": 1}\r\n\r\n: keep-alive\n\nevent: x\ndata: two\ndata: lines\n\n'
              'data: caf\u00e9\n\ndata: [DONE]\n\n').encode()
    decoder = SSEDecoder()
    events = [e for i in range(len(stream)) for e in decoder.feed(stream[i:i + 1])]  # one byte at a time
    assert events == ['{"a": 1}', "two\nlines", "caf\u00e9", "[DONE]"]


def test_summary_has_vllm_definitions():
    a = RequestResult("a", content_times_s=[0.1, 0.2, 0.4], e2e_s=0.5, prompt_tokens=10, output_tokens=5,
                      tokens_from_usage=True)
    b = RequestResult("b", content_times_s=[0.2, 0.3], e2e_s=0.5, prompt_tokens=20, output_tokens=3,
                      tokens_from_usage=True)
    one = RequestResult("c", content_times_s=[0.3], e2e_s=0.3, prompt_tokens=1, output_tokens=1,
                        tokens_from_usage=True)  # one token: no TPOT
    failed = RequestResult("d", content_times_s=[0.1], error="HTTP 500: no")
    s = summarize_run([a, b, one, failed], duration_s=2.0, percentiles=(99.0, 90.0))
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (3, 1, 31, 9)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.5 and s["total_token_throughput"] == 20.0
    # TPOT = (E2E - TTFT) / (tokens - 1): a 100 ms, b 150 ms; c has none.
    assert s["mean_tpot_ms"] == pytest.approx(125) and s["median_tpot_ms"] == pytest.approx(125)
    assert s["p99_tpot_ms"] == pytest.approx(149.5) and s["p90_tpot_ms"] == pytest.approx(145)
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["mean_itl_ms"] == pytest.approx(400 / 3, abs=1e-3)  # gaps 100, 200 (a) and 100 (b), pooled
    assert s["median_itl_ms"] == pytest.approx(100)
    assert (s["max_itl_ms"], s["max_ttft_ms"], s["max_tpot_ms"]) == pytest.approx((200, 300, 150))
    assert s["mean_e2el_ms"] == pytest.approx(1300 / 3, abs=1e-3)
    assert s["std_ttft_ms"] == pytest.approx(float(np.std([100, 200, 300])), abs=1e-3)
    assert s["errors"] == {"HTTP 500: no": 1} and s["tokens_from_usage"] is True
    empty = summarize_run([failed], 1.0, (99.0,))
    assert empty["completed"] == 0 and empty["median_ttft_ms"] is None and empty["p99_itl_ms"] is None
    assert empty["max_itl_ms"] is None


def test_metrics_scrape_gives_acceptance_and_hit_rate():
    before = server_counters(parse_prometheus(metrics_text(2)))
    after = server_counters(parse_prometheus(metrics_text(6)))
    spec = spec_summary(before, after)
    assert (spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (20, 80, 40)
    assert spec["mean_acceptance_length"] == 3.0  # 1 + accepted / drafts
    assert spec["acceptance_rate"] == 0.5
    assert spec["acceptance_rate_per_position"] == [0.8, 0.6, 0.4, 0.2]
    assert spec["cache_hit_rate"] == 0.75 and spec["cache_hits_metric"] == "trtssd:spec_decode_cache_hits"
    assert spec_summary(None, after) is None
    assert spec_summary({}, {}) == {}  # a server without these metrics: nothing to report, no error


def test_arrival_offsets_are_poisson_at_the_rate():
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    t = arrival_offsets(20000, 50.0, 1.0, seed=3)
    gaps = np.diff(t)
    assert t[0] == 0.0 and t == arrival_offsets(20000, 50.0, 1.0, seed=3)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_offsets(20000, 50.0, 0.25, seed=3))
    assert bursty.mean() == pytest.approx(1 / 50, rel=0.05) and bursty.std() / bursty.mean() > 1.7


# --- against the stand-in ------------------------------------------------------------------------


def test_concurrency_sweep_measures_known_timings(tmp_path):
    server = StandIn()
    with serving(server) as url:
        cfg = config(tmp_path, url, [f"prompt {i}" for i in range(6)], loads=(Load(1), Load(3)), label="standin")
        report = run_serve_benchmark(cfg, "test")
    assert report.model == "standin" and server.max_in_flight == 3 and server.served == 13  # 12 + the warm-up
    tokens, expected_e2e = 15, 0.10 + 4 * 0.04
    for run in report.runs:
        s = run.summary
        assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (6, 0, 90, 42)
        assert s["tokens_from_usage"] is True  # 15 tokens each from usage, not 5 chunks
        # The stand-in sleeps exactly these times: a measurement is never shorter; on a busy shared
        # machine it can be much longer, so the upper bounds are loose.
        assert 95 <= s["median_ttft_ms"] <= 100 + 150
        assert 35 <= s["median_itl_ms"] <= 40 + 60
        assert expected_e2e * 1e3 - 10 <= s["median_e2el_ms"] <= expected_e2e * 1e3 + 250
        assert s["median_tpot_ms"] == pytest.approx((expected_e2e - 0.10) / (tokens - 1) * 1e3, abs=3)
        assert len([g for r in run.requests for g in r.itl_s]) == 6 * 4  # gaps between chunks, not tokens
        for r in run.requests:
            assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (tokens - 1))
        # Exactly the 6 requests of the run, the warm-up excluded: 1 + 10 / 5 and 3 / (3 + 1).
        assert run.spec["drafts"] == 30 and run.spec["mean_acceptance_length"] == 3.0
        assert run.spec["cache_hit_rate"] == 0.75 and run.spec["acceptance_rate_per_position"] == [0.8, 0.6, 0.4, 0.2]
        assert len(run.loadavg_start) == 3 and len(run.loadavg_end) == 3
    c1, c3 = report.runs
    # One at a time: 6 back-to-back requests; three at a time: two waves.
    # Never faster than the stand-in's sleeps allow; loosely bounded above (shared machine).
    assert 6 * expected_e2e * 0.95 <= c1.summary["duration_s"] <= 6 * expected_e2e * 2
    assert 2 * expected_e2e * 0.95 <= c3.summary["duration_s"] <= 2 * expected_e2e * 2
    assert 90 / (6 * expected_e2e) / 2 <= c1.summary["output_throughput"] <= 90 / (6 * expected_e2e) * 1.05

    files = write_report(report, tmp_path / "out")
    assert [f.name for f in files] == ["results.json", "results.md", "serve.png"]
    data = json.loads(files[0].read_text())
    assert data["label"] == "standin" and len(data["loadavg_start"]) == 3 and len(data["loadavg_end"]) == 3
    assert [r["concurrency"] for r in data["runs"]] == [1, 3] and data["runs"][0]["request_rate"] is None
    assert len(data["runs"][0]["requests"]) == 6 and data["runs"][0]["summary"]["p99_ttft_ms"] is not None
    md = files[1].read_text()
    assert "| c=1 | 6 | 0 |" in md and "| c=3 | 6 | 0 |" in md and "3.00" in md
    assert files[2].read_bytes()[:4] == b"\x89PNG"


def test_failures_are_counted_not_fatal(tmp_path):
    server = StandIn(Script(ttft_s=0.02, gap_s=0.01))
    prompts = ["ok 0", "FAIL 1", "ok 2", "DROP 3", "ok 4", "ok 5"]
    with serving(server) as url:
        report = run_serve_benchmark(config(tmp_path, url, prompts, loads=(Load(2),), warmup=False))
    s = report.runs[0].summary
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (4, 2, 60)
    assert s["errors"].get("HTTP 500: stand-in refuses") == 1
    errors = {r.prompt_id: r.error for r in report.runs[0].requests if not r.ok}
    assert set(errors) == {"prompts/q1", "prompts/q3"}  # FAIL and DROP
    assert "500" not in errors["prompts/q3"]  # a disconnect mid-stream is a failed request too
    assert report.runs[0].spec["drafts"] == 4 * DRAFTS  # only served requests moved the counters


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_first_token_without_text_is_the_first_token(tmp_path, endpoint):
    """A special token decodes to no text, yet it is a token: TTFT is its chunk's arrival, as in
    `vllm bench serve` (counting only chunks with text put the first round of a speculative
    server, not its first token, into TTFT)."""
    server = StandIn(Script(ttft_s=0.08, gap_s=0.3, silent_first=True, metrics=False))
    with serving(server) as url:
        report = run_serve_benchmark(config(tmp_path, url, ["a", "b"], endpoint=endpoint, loads=(Load(1),)))
    s = report.runs[0].summary
    assert s["completed"] == 2 and 75 <= s["median_ttft_ms"] <= 80 + 150  # not 80 + 300
    assert len([g for r in report.runs[0].requests for g in r.itl_s]) == 2 * 4


def test_chat_endpoint_request_rate_and_body(tmp_path):
    server = StandIn(Script(ttft_s=0.08, gap_s=0.02, metrics=False))
    with serving(server) as url:
        cfg = config(tmp_path, url, [f"question {i}" for i in range(5)], endpoint="/v1/chat/completions",
                     loads=(Load(None, 20.0),), temperature=0.5, ignore_eos=True, extra_body={"top_k": 5})
        report = run_serve_benchmark(cfg)
    run = report.runs[0]
    assert run.summary["completed"] == 5 and run.spec is None  # no /metrics: reported as absent, not an error
    # The role-only delta arrives at once; the first token 80 ms later is what TTFT measures.
    assert 75 <= run.summary["median_ttft_ms"] <= 80 + 150
    body = server.bodies[-1]
    assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"].startswith("question")
    assert (body["stream"], body["stream_options"], body["ignore_eos"], body["temperature"], body["top_k"],
            body["max_tokens"], body["model"]) == (True, {"include_usage": True}, True, 0.5, 5, 15, "standin")
    # Poisson arrivals at 20/s with no cap: each request goes out at its scheduled time.
    sent = sorted(r.sent_s for r in run.requests)
    assert sent == pytest.approx(arrival_offsets(5, 20.0, 1.0, 0), abs=0.05)


def test_triton_generate_stream_backend(tmp_path):
    server = StandIn()
    with serving(server) as url:
        cfg = config(tmp_path, url, [f"prompt {i}" for i in range(4)], loads=(Load(2),), backend="triton",
                     metrics_url=url + "/metrics", ignore_eos=True)
        report = run_serve_benchmark(cfg, "test")
    assert report.model == "trtssd" and server.served == 5  # 4 + the warm-up
    body = server.bodies[-1]
    assert (body["model"], body["stream"], body["exclude_input_in_output"], body["ignore_eos"], body["max_tokens"]) \
        == ("trtssd", True, True, True, 15) and body["text_input"].startswith("prompt")
    s = report.runs[0].summary
    # Tokens from num_output_tokens (15 each), not from the 5 events; the stream's close is its end.
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (4, 0, 60, 28)
    assert s["tokens_from_usage"] is True and 95 <= s["median_ttft_ms"] <= 100 + 150
    assert 0.10 + 4 * 0.04 - 0.01 <= s["median_e2el_ms"] / 1e3 <= 0.10 + 4 * 0.04 + 0.25
    assert report.runs[0].spec["drafts"] == 4 * DRAFTS  # scraped from --metrics-url
    with pytest.raises(ValueError, match="backend must be one of openai, triton"):
        ServeConfig(backend="grpc")


def test_cli_runs_and_compares(tmp_path, capsys):
    from trtssd.cli import main

    dirs = []
    # Same timings, twice the tokens per chunk (a speculative server): twice the output throughput.
    for label, per_chunk in (("ar", 3), ("ssd", 6)):
        server = StandIn(Script(ttft_s=0.03, gap_s=0.02, tokens_per_chunk=per_chunk))
        with serving(server) as url:
            out = tmp_path / label
            rc = main(["bench", "serve", "--base-url", url, "--datasets", prompts_file(tmp_path, ["a", "b", "c", "d"]),
                       "--num-prompts", "4", "--concurrency", "1,2", "--max-tokens", "15", "--label", label,
                       "--out", str(out), "--log-level", "WARNING"])
        assert rc == 0 and (out / "results.json").is_file() and (out / "serve.png").is_file()
        dirs.append(str(out))
    assert "| c=2 | 4 | 0 |" in capsys.readouterr().out
    rc = main(["bench", "serve", "--compare", *dirs, "--out", str(tmp_path / "cmp"), "--log-level", "WARNING"])
    assert rc == 0
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| load | ar | ssd | ssd / ar |" in md and (tmp_path / "cmp" / "compare.png").is_file()
    assert "ITL p50 | ITL p99 | ITL max |" in md
    # The longest gap of each run, as each results.json recorded it.
    for label in ("ar", "ssd"):
        c2 = json.loads((tmp_path / label / "results.json").read_text())["runs"][1]
        assert f"| c=2 | {label} |" in md and f" {c2['summary']['max_itl_ms']:.1f} |" in md
    merged = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    for ar, ssd in zip(merged["runs"]["ar"], merged["runs"]["ssd"]):
        assert ssd["summary"]["output_throughput"] / ar["summary"]["output_throughput"] == pytest.approx(2.0, rel=0.2)


def test_unreachable_server_and_bad_arguments(tmp_path):
    from trtssd.bench.serve import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--base-url", f"http://127.0.0.1:{port}", "--datasets", prompts_file(tmp_path, ["a"]),
                 "--out", str(tmp_path / "x"), "--log-level", "CRITICAL"]) == 1
    for bad in (["--concurrency", "0"], ["--request-rate", "-1"], ["--datasets", "nope.jsonl"], ["--compare", "one"]):
        with pytest.raises(SystemExit) as err:
            main([*bad, "--out", str(tmp_path / "y")])
        assert err.value.code == 2
