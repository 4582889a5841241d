"""Measures, against a running `trtssd serve` at concurrency 1, what `n` and the penalties cost:

- ``n``: one completion request with ``n`` = 8 (the prompt prefilled once, its 8 samples decoded
  together) against 8 separate requests of the same prompt sent at once (8 prefills): time to the
  first token (of any sample, and of the last sample to start) and tokens/s over the whole request;
- penalties: one request with ``presence_penalty`` 0.5, ``frequency_penalty`` 0.5,
  ``repetition_penalty`` 1.1 and ``logit_bias`` on a few ids, against the same request without
  them: seconds per output token after the first (TPOT) and tokens/s.

Each repetition uses a prompt of its own (a number and shuffled words before the same text), so
the prefix cache finds nothing from an earlier repetition; the two sides of each comparison
alternate. Writes results.json and results.md beside this file (or --out), with the machine's load
average at the start and the end. Sampling is seeded (temperature 0.8) so both sides generate the
same kind of text; every request ignores EOS, so every sample has --max-tokens tokens.

    .venv/bin/python docs/bench/n-samples-and-penalties/measure.py --base-url http://127.0.0.1:18471
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from trtssd.bench.serve import SSEDecoder

HERE = Path(__file__).parent
WORDS = ("the river carries cold water from the mountains past old mills and quiet towns where people "
         "fish in the morning and talk about the weather the harvest and the price of bread").split()
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
             "logit_bias": {"13": -5, "28": 3, "216": -2, "1370": 4}}


@dataclass
class Stream:
    """One streamed completion: when each choice's token chunks arrived (seconds from the send)."""

    arrivals: dict[int, list[float]] = field(default_factory=dict)  # choice index -> chunk arrival times
    tokens: dict[int, int] = field(default_factory=dict)  # choice index -> completion tokens
    end_s: float = 0.0


def prompt(rep: int, words: int) -> str:
    rng = random.Random(rep)
    return f"Document {rep}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\nSummary:"


async def complete(client: httpx.AsyncClient, body: dict) -> Stream:
    """POST one streaming completion with token ids per choice; time every chunk."""
    result, decoder, t0 = Stream(), SSEDecoder(), time.perf_counter()
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                "return_token_ids": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()}")
        async for chunk in response.aiter_bytes():
            now = time.perf_counter() - t0
            for data in decoder.feed(chunk):
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                for choice in event["choices"]:
                    ids = choice.get("token_ids") or []
                    if ids:
                        result.arrivals.setdefault(choice["index"], []).append(now)
                        result.tokens[choice["index"]] = result.tokens.get(choice["index"], 0) + len(ids)
    result.end_s = time.perf_counter() - t0
    return result


async def n_round(client: httpx.AsyncClient, base: dict, n: int, together: bool) -> dict:
    """``n`` samples of one prompt: one request (together) or n requests sent at once."""
    t0 = time.perf_counter()
    if together:
        streams = [await complete(client, {**base, "n": n})]
    else:
        streams = await asyncio.gather(*(complete(client, base) for _ in range(n)))
    wall = time.perf_counter() - t0
    firsts = sorted(times[0] for s in streams for times in s.arrivals.values())
    tokens = sum(sum(s.tokens.values()) for s in streams)
    return {"ttft_first_s": firsts[0], "ttft_last_s": firsts[-1], "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall}


async def penalty_round(client: httpx.AsyncClient, base: dict, penalised: bool) -> dict:
    stream = await complete(client, {**base, **(PENALTIES if penalised else {})})
    times, tokens = stream.arrivals[0], stream.tokens[0]
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else 0.0
    return {"ttft_s": times[0], "tpot_s": tpot, "tokens": tokens, "tokens_per_s": tokens / stream.end_s}


def summary(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k != "tokens"]
    return {k: statistics.median(r[k] for r in rows) for k in keys} | {"tokens": rows[0]["tokens"],
                                                                       "repetitions": len(rows)}


async def run(args) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.8, "seed": 1,
                "ignore_eos": True}
        await complete(client, {**body, "prompt": prompt(-1, args.prompt_words), "max_tokens": 4})  # warm-up
        n_rows: dict[str, list[dict]] = {"n=8, one request": [], "8 separate requests": []}
        penalty_rows: dict[str, list[dict]] = {"without penalties": [], "with penalties": []}
        for rep in range(args.repetitions):
            order = [True, False] if rep % 2 == 0 else [False, True]  # alternated: drift falls on both
            for together in order:
                base = {**body, "prompt": prompt(2 * rep + together, args.prompt_words)}
                label = "n=8, one request" if together else "8 separate requests"
                n_rows[label].append(await n_round(client, base, args.n, together))
            for penalised in order:
                base = {**body, "prompt": prompt(10_000 + 2 * rep + penalised, args.prompt_words)}
                label = "with penalties" if penalised else "without penalties"
                penalty_rows[label].append(await penalty_round(client, base, penalised))
    return {"n": {k: summary(v) for k, v in n_rows.items()}, "penalties": {k: summary(v) for k, v in penalty_rows.items()},
            "runs": {"n": n_rows, "penalties": penalty_rows}}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = ["# n samples and penalties at concurrency 1", "",
             f"`{s['command']}`; server `{s['server']}`; prompts of {s['prompt_words']} words, "
             f"{s['max_tokens']} tokens per sample (EOS ignored), temperature 0.8, seeded; median of "
             f"{s['repetitions']} alternated repetitions; load average {result['loadavg_start']} at the start, "
             f"{result['loadavg_end']} at the end ({result['machine']}).", "",
             f"| {s['n']} samples of one prompt | TTFT, first sample (ms) | TTFT, last sample (ms) | wall (s) | tokens | tokens/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, r in result["n"].items():
        lines.append(f"| {label} | {1000 * r['ttft_first_s']:.0f} | {1000 * r['ttft_last_s']:.0f} | {r['wall_s']:.2f} | "
                     f"{r['tokens']} | {r['tokens_per_s']:.1f} |")
    lines += ["", "| one request | TTFT (ms) | per output token (ms) | tokens/s |", "|---|---:|---:|---:|"]
    for label, r in result["penalties"].items():
        lines.append(f"| {label} | {1000 * r['ttft_s']:.0f} | {1000 * r['tpot_s']:.2f} | {r['tokens_per_s']:.1f} |")
    lines += ["", f"Penalties: {json.dumps(PENALTIES)}. They change the text, and with it how many proposals a "
              "speculative round accepts: the per-token time includes that, not only the logits' processing."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--server", default="trtssd serve", help="how the server was started (for the report)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--repetitions", type=int, default=6)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    result = asyncio.run(run(args))
    result.update(loadavg_start=load_start, loadavg_end=[round(x, 2) for x in os.getloadavg()],
                  machine=f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} usable cores",
                  settings={"command": "bash docs/bench/n-samples-and-penalties/run.sh", "server": args.server,
                            "n": args.n, "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
                            "repetitions": args.repetitions})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
