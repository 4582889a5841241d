"""Prefix cache hit rate with speculation on and off, read from `/metrics`.

`trtssd serve` on the default ggml engine (engines/smollm2-135m-ggml) three times: `--mode ar`,
the default mode, and `--mode ssd --no-plain-under-load` (speculation in every round). Against
each, `trtssd bench prefill --scenario turns`: chat sessions one after another sharing a system
prompt, each turn resending the whole history and the previous answer (greedy, streamed). The
prefix-cache counters' increase over the run gives each rank's hit rate (hits / queries, prompt
tokens); the answers are compared to show the modes served the same requests.

    .venv/bin/python docs/bench/prefix-cache-hit-rate-with-speculation/run.py [--engine DIR]

Writes result.md and result.json beside itself (and each run's bench output and server log under
runs/, git-ignored by name: only the results are committed). A few minutes on 2 cores; a hit rate
is not a timing, so a busy machine gives the same numbers.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

log = logging.getLogger("prefix-cache-hit-rate")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TRTSSD = str(ROOT / ".venv" / "bin" / "trtssd")
PORT = 18473
WORKLOAD = ["--sessions", "2", "--turns", "4", "--system-words", "200", "--max-tokens", "16"]
MODES = {"ar": ["--mode", "ar"], "default": [], "ssd (always speculating)": ["--mode", "ssd", "--no-plain-under-load"]}
COUNTERS = {"target_queries": "vllm:prefix_cache_queries_total", "target_hits": "vllm:prefix_cache_hits_total",
            "draft_queries": "trtssd:draft_prefix_cache_queries_total",
            "draft_hits": "trtssd:draft_prefix_cache_hits_total"}


def counters(url: str) -> dict[str, float]:
    """The prefix-cache counters of one scrape (0 for a series not made yet)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = {key: re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M) for key, name in COUNTERS.items()}
    return {key: float(m.group(1)) if m else 0.0 for key, m in found.items()}


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(1)
    raise TimeoutError("the server did not become healthy")


def run_mode(label: str, options: list[str], engine: str) -> dict:
    """One server in one mode: the counters' increase over the workload and the answers."""
    out = HERE / "runs" / re.sub(r"\W+", "-", label).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{PORT}"
    with open(out / "server.log", "w") as server_log:
        server = subprocess.Popen([TRTSSD, "serve", "--port", str(PORT), "--engine", engine, *options],
                                  stdout=server_log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_healthy(url, server)
            before = counters(url)
            subprocess.run([TRTSSD, "bench", "prefill", "--scenario", "turns", "--label", label, "--out", str(out),
                            "--base-url", url, *WORKLOAD], check=True, cwd=ROOT)
            after = counters(url)
        finally:
            server.terminate()
            server.wait(timeout=60)
    requests = json.loads((out / "result.json").read_text())["requests"]
    increase = {key: after[key] - before[key] for key in COUNTERS}
    return {"mode": label, "options": options, **increase, "answers": [r["text"] for r in requests]}


def rate(hits: float, queries: float) -> str:
    return f"{hits / queries:.1%}" if queries else "-"


def render(rows: list[dict], command: str) -> str:
    same = all(row["answers"] == rows[0]["answers"] for row in rows)
    lines = ["# Prefix cache hit rate with speculation on and off", "",
             f"`{command}`", "",
             f"Workload: `trtssd bench prefill --scenario turns {' '.join(WORKLOAD)}` and its warm-up request.",
             "Counters' increase over the run, in prompt tokens.", "",
             "| mode | target queries | target hits | target hit rate | draft queries | draft hits | draft hit rate |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['target_queries']:.0f} | {r['target_hits']:.0f} | "
                     f"{rate(r['target_hits'], r['target_queries'])} | {r['draft_queries']:.0f} | "
                     f"{r['draft_hits']:.0f} | {rate(r['draft_hits'], r['draft_queries'])} |")
    lines += ["", f"Answers identical across the modes: {'yes' if same else 'NO'}."]
    for r in rows:
        unseen = r["target_queries"] - r["draft_queries"]
        if r["draft_queries"] and unseen:  # the draft counts only the prompts of requests it speculated for
            lines.append(f"{r['mode']}: the draft looked up {unseen:.0f} prompt tokens fewer than the target, the "
                         "prompts of requests load control decoded plainly throughout.")
    return "\n".join(lines) + "\n"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape would bury the results
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default=str(ROOT / "engines" / "smollm2-135m-ggml"))
    args = parser.parse_args()
    command = "python docs/bench/prefix-cache-hit-rate-with-speculation/run.py"
    rows = []
    for label, options in MODES.items():
        log.info("mode %s", label)
        rows.append(run_mode(label, options, args.engine))
    (HERE / "result.json").write_text(json.dumps({"command": command, "engine": args.engine,
                                                  "workload": WORKLOAD, "rows": rows}, indent=1) + "\n")
    (HERE / "result.md").write_text(render(rows, command))
    log.info("%s", (HERE / "result.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
