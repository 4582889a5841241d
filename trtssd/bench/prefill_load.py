"""Serving benchmarks of prompt work, against a running OpenAI-compatible server:

- ``turns``: multi-turn chat. Sessions share one long system prompt; each session has several
  turns, each turn's messages being the earlier turns, their answers and a new question. Time to
  first token by turn shows what prefix caching saves: from the second turn on, everything but the
  last answer and the new question was in an earlier prompt.
- ``arrivals``: streams of short prompts at a fixed concurrency while long prompts arrive now and
  then. The short streams' inter-token latency (the gaps between streamed deltas) shows what a
  long prefill costs everyone else, and what chunked prefill saves. A speculative round's delta
  holds several tokens, so compare latencies within one mode; tokens/s counts tokens (usage).

`trtssd bench prefill --scenario turns|arrivals --base-url URL --out DIR` writes result.json and
result.md. Requests stream (chat completions), greedy, ignore_eos.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from trtssd.bench.records import percentile
from trtssd.bench.report import machine_info
from trtssd.bench.serve import SSEDecoder, loadavg

log = logging.getLogger(__name__)

SCENARIOS = ("turns", "arrivals")
_WORDS = ("queue", "tensor", "river", "lattice", "signal", "harbor", "kernel", "meadow", "cipher", "vector",
          "granite", "orbit", "thread", "prism", "ledger", "summit", "socket", "ember", "canyon", "matrix")


def filler_text(words: int, seed: int) -> str:
    """Deterministic text of about ``words`` words (a system prompt, tool schemas, a document)."""
    return " ".join(_WORDS[(i * 7 + seed * 13 + (i // 5) * 3) % len(_WORDS)] for i in range(words))


@dataclass
class Timing:
    kind: str  # "turn N", "short" or "long"
    ttft_s: float | None = None
    tokens: int = 0  # completion tokens (the usage chunk): a speculative round's delta holds several
    token_gaps_s: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None


async def chat_stream(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int,
                      kind: str) -> Timing:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    timing = Timing(kind)
    start = last = time.perf_counter()
    decoder = SSEDecoder()
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            timing.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return timing
        async for chunk in resp.aiter_bytes():
            for data in decoder.feed(chunk):
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if event.get("usage"):
                    timing.tokens = event["usage"]["completion_tokens"]
                if not event.get("choices"):
                    continue
                delta = event["choices"][0]["delta"].get("content") or ""
                if not delta:
                    continue
                now = time.perf_counter()
                if timing.ttft_s is None:
                    timing.ttft_s = now - start
                else:
                    timing.token_gaps_s.append(now - last)
                last = now
                timing.text += delta
    return timing


async def run_turns(client, model: str, sessions: int, turns: int, system_words: int, max_tokens: int) -> list[Timing]:
    """Sessions one after another (TTFT then measures prompt work, not queueing)."""
    system = {"role": "system", "content": "You answer questions about this reference.\n" + filler_text(system_words, 0)}
    out = []
    for s in range(sessions):
        messages = [system]
        for t in range(1, turns + 1):
            messages.append({"role": "user", "content": f"Question {t} of session {s}: {filler_text(25, 100 * s + t)}?"})
            timing = await chat_stream(client, model, messages, max_tokens, f"turn {t}")
            out.append(timing)
            messages.append({"role": "assistant", "content": timing.text})
    return out


async def run_arrivals(client, model: str, concurrency: int, duration_s: float, long_every_s: float,
                       long_words: int, max_tokens: int) -> list[Timing]:
    """``concurrency`` short streams back to back for ``duration_s``, and a long prompt every
    ``long_every_s`` seconds (each with a new text: no prefix to reuse)."""
    end = time.perf_counter() + duration_s
    out: list[Timing] = []

    async def shorts(worker: int) -> None:
        i = 0
        while time.perf_counter() < end:
            question = {"role": "user", "content": f"Short question {worker}.{i}: {filler_text(20, 7 * worker + i)}?"}
            out.append(await chat_stream(client, model, [question], max_tokens, "short"))
            i += 1

    async def longs() -> None:
        i = 0
        while time.perf_counter() + long_every_s < end:
            await asyncio.sleep(long_every_s)
            document = {"role": "user", "content": f"Summarize document {i}: {filler_text(long_words, 1000 + i)}"}
            out.append(await chat_stream(client, model, [document], 8, "long"))
            i += 1

    await asyncio.gather(longs(), *(shorts(w) for w in range(concurrency)))
    return out


def _stats(values: list[float]) -> dict:
    """Milliseconds; p99 as `trtssd bench serve` computes it, max for the longest stall."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean_ms": round(1000 * statistics.fmean(values), 1),
            "p50_ms": round(1000 * percentile(values, 50), 1), "p99_ms": round(1000 * percentile(values, 99), 1),
            "max_ms": round(1000 * max(values), 1)}


def summarize(timings: list[Timing]) -> dict:
    kinds = sorted({t.kind for t in timings}, key=lambda k: (len(k), k))
    return {"errors": [t.error for t in timings if t.error],
            "ttft_by_kind": {k: _stats([t.ttft_s for t in timings if t.kind == k and t.ttft_s is not None])
                             for k in kinds},
            "itl_by_kind": {k: _stats([g for t in timings if t.kind == k for g in t.token_gaps_s]) for k in kinds},
            "tokens_by_kind": {k: sum(t.tokens for t in timings if t.kind == k) for k in kinds}}


def render(result: dict) -> str:
    lines = [f"# {result['label']}: {result['scenario']}", "", f"`{result['command']}`", "",
             f"load average at start / end: {result['loadavg_start']} / {result['loadavg_end']}; "
             f"{result['wall_s']:.0f} s", "",
             "| requests | n | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL max ms | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    summary = result["summary"]
    for kind, ttft in summary["ttft_by_kind"].items():
        itl = summary["itl_by_kind"][kind]
        rate = summary["tokens_by_kind"][kind] / result["wall_s"]
        lines.append(f"| {kind} | {ttft['n']} | {ttft.get('p50_ms')} | {ttft.get('p99_ms')} | "
                     f"{itl.get('p50_ms')} | {itl.get('p99_ms')} | {itl.get('max_ms', '-')} | {rate:.1f} |")
    if summary["errors"]:
        lines += ["", f"errors: {summary['errors'][:5]}"]
    return "\n".join(lines) + "\n"


async def _run(args) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout_s) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        await chat_stream(client, model, [{"role": "user", "content": "Hello"}], 4, "warm-up")
        if args.scenario == "turns":
            return await run_turns(client, model, args.sessions, args.turns, args.system_words, args.max_tokens)
        return await run_arrivals(client, model, args.concurrency, args.duration_s, args.long_every_s,
                                  args.long_words, args.max_tokens)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtssd bench prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--label", default="server")
    p.add_argument("--out", required=True, help="directory for result.json and result.md")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--sessions", type=int, default=3, help="turns: chat sessions, one after another")
    p.add_argument("--turns", type=int, default=8, help="turns: turns per session")
    p.add_argument("--system-words", type=int, default=600, help="turns: words of the shared system prompt")
    p.add_argument("--concurrency", type=int, default=8, help="arrivals: short streams at once")
    p.add_argument("--duration-s", type=float, default=60.0, help="arrivals: how long the short streams run")
    p.add_argument("--long-every-s", type=float, default=8.0, help="arrivals: seconds between long prompts")
    p.add_argument("--long-words", type=int, default=900, help="arrivals: words of each long prompt")
    return p


def main(argv: list[str], command: str) -> int:
    args = build_parser().parse_args(argv)
    start_load, start = loadavg(), time.perf_counter()
    timings = asyncio.run(_run(args))
    wall_s = time.perf_counter() - start
    result = {"label": args.label, "scenario": args.scenario, "command": command, "options": vars(args),
              "machine": machine_info(), "loadavg_start": start_load, "loadavg_end": loadavg(),
              "wall_s": wall_s,
              "summary": summarize(timings), "requests": [asdict(t) for t in timings]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "result.md").write_text(render(result))
    log.info("%s", render(result))
    return 1 if result["summary"]["errors"] else 0
