"""Structured outputs served end to end: `trtssd serve` (default mode, and --mode ar) against
llama-server on the same GGUF, chat prompts asking for JSON of a schema (workload.json), the
OpenAI `response_format` json_schema on every server, greedy, one request at a time (and at
concurrency 4). Per server: the sum over the set of the time from request to the last token,
completion tokens, tokens/s, and whether every answer validates. Writes results.json.

    bash docs/bench/structured-outputs-vs-llama-server/run.sh
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
from openai import OpenAI

from trtssd.bench.llamacpp import LlamaServer, ServerOptions, ensure_llama_server

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def ask(item: dict) -> list[dict]:
    return [{"role": "user", "content": f"{item['prompt']} Answer in JSON."}]


def one_request(client: OpenAI, model: str, item: dict, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    reply = client.chat.completions.create(
        model=model, messages=ask(item), temperature=0, max_tokens=max_tokens,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": item["schema"]}})
    e2e = time.perf_counter() - t0
    text = reply.choices[0].message.content or ""
    try:
        jsonschema.validate(json.loads(text), item["schema"])
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {"e2e_s": e2e, "tokens": reply.usage.completion_tokens, "valid": valid, "text": text,
            "finish_reason": reply.choices[0].finish_reason}


FORCED = {"forced_rounds": "trtssd:structured_output_forced_rounds",
          "forced_tokens": "trtssd:structured_output_forced_tokens",
          "forced_accepted": "trtssd:structured_output_forced_accepted_tokens",
          "mask_s": "trtssd:structured_output_mask_seconds",
          "generated": "vllm:generation_tokens"}


def counters(base_url: str) -> dict[str, float]:
    """trtssd's structured-output counters from /metrics (empty for a server without them)."""
    try:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = dict.fromkeys(FORCED, 0.0)
    for line in text.splitlines():
        for key, name in FORCED.items():
            if line.startswith(name + "_total") or line.startswith(name + " ") or line.startswith(name + "{"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def forced_share(before: dict, after: dict) -> dict:
    """Share of generated tokens the grammar proposed, their acceptance, the mask cost per token."""
    if not before:
        return {}
    d = {k: after[k] - before[k] for k in FORCED}
    return {"forced_share": round(d["forced_accepted"] / d["generated"], 3) if d["generated"] else None,
            "forced_acceptance": round(d["forced_accepted"] / d["forced_tokens"], 3) if d["forced_tokens"] else None,
            "mask_us_per_token": round(1e6 * d["mask_s"] / d["generated"], 1) if d["generated"] else None}


def run_set(base_url: str, model: str, workload: list[dict], concurrency: int, max_tokens: int) -> dict:
    client = OpenAI(base_url=base_url, api_key="none", timeout=600)
    one_request(client, model, workload[0], 8)  # warm-up
    before = counters(base_url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda it: one_request(client, model, it, max_tokens), workload))
    wall = time.perf_counter() - t0
    tokens = sum(a["tokens"] for a in answers)
    return {"concurrency": concurrency, "sum_e2e_s": round(sum(a["e2e_s"] for a in answers), 3),
            "wall_s": round(wall, 3), "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "all_valid": all(a["valid"] for a in answers), **forced_share(before, counters(base_url)),
            "answers": answers}


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"trtssd serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError("trtssd serve not healthy in time")


def trtssd_server(engine: Path, port: int, mode: str | None) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).with_name("trtssd")), "serve", "--engine", str(engine), "--port", str(port),
           "--max-batch", "4"] + (["--mode", mode] if mode else [])
    log = Path(tempfile.gettempdir()) / f"trtssd-serve-{mode or 'default'}.log"
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def measure_trtssd(engine: Path, mode: str | None, workload, levels, max_tokens) -> list[dict]:
    port = 8700 + (1 if mode else 0)
    proc = trtssd_server(engine, port, mode)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        time.sleep(5)  # settled: the draft's start-up work done
        return [run_set(f"http://127.0.0.1:{port}/v1", engine.name, workload, c, max_tokens) for c in levels]
    finally:
        proc.terminate()
        proc.wait(60)


def measure_llama_server(gguf: Path, workload, levels, max_tokens) -> list[dict]:
    # As a user starts it on 2 cores: both threads, 4 slots (one per concurrent request here).
    with LlamaServer(ServerOptions(model=gguf, threads=2, parallel=4, ctx_per_slot=2048), ensure_llama_server()) as server:
        return [run_set(server.url + "/v1", "model", workload, c, max_tokens) for c in levels]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default=str(ROOT / "engines" / "qwen2.5-coder-1.5b-ggml"))
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(HERE / "results.json"))
    ap.add_argument("--no-llama-server", action="store_true", help="trtssd's two modes only (an engine without a GGUF target)")
    args = ap.parse_args()
    engine = Path(args.engine)
    workload = json.loads((HERE / "workload.json").read_text())
    levels = [int(c) for c in args.concurrency.split(",")]
    results = {"engine": engine.name, "load_average_before": os.getloadavg(), "systems": {}}
    results["systems"]["trtssd serve (default mode)"] = measure_trtssd(engine, None, workload, levels, args.max_tokens)
    results["systems"]["trtssd serve --mode ar"] = measure_trtssd(engine, "ar", workload, levels, args.max_tokens)
    if not args.no_llama_server:
        results["systems"]["llama-server -t 2 --parallel 4"] = measure_llama_server(
            engine / "target" / "model.gguf", workload, levels, args.max_tokens)
    results["load_average_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    for name, runs in results["systems"].items():
        for r in runs:
            print(f"{name:34s} c={r['concurrency']}  sum e2e {r['sum_e2e_s']:7.2f} s  {r['tokens_per_s']:6.2f} tok/s  "
                  f"tokens {r['completion_tokens']}  valid {r['all_valid']}  forced share {r.get('forced_share')}  "
                  f"acceptance {r.get('forced_acceptance')}  mask us/token {r.get('mask_us_per_token')}")


if __name__ == "__main__":
    main()
