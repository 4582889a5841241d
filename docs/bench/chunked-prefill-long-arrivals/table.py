"""compare.md from the runs beside this file: the short streams' latencies and rate, the long prompts' TTFT."""

import json
import sys
from pathlib import Path

from trtssd.bench.records import read_result

here = Path(__file__).parent
labels = sys.argv[1:] or ["ar-whole", "ar-chunk-256", "ssd-whole", "ssd-chunk-256", "ssd-chunk-128", "ssd-chunk-512"]
lines = ["# Short streams while long prompts arrive: whole-prompt prefill against chunks", "",
         "`bash docs/bench/chunked-prefill-long-arrivals/run.sh`; 8 short chat streams for 90 s, a 900-word prompt "
         "every 8 s; ms.", "",
         "| run | load avg at start | short ITL p50 | short ITL p99 | short TTFT p50 | short TTFT p99 | "
         "short tokens/s | long TTFT p50 | long TTFT p99 |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
for label in labels:
    path = here / label / "result.json"
    if not (path.exists() or path.with_name("result.json.gz").exists()):
        continue
    run = read_result(path)
    s = run["summary"]
    itl, ttft, long = s["itl_by_kind"]["short"], s["ttft_by_kind"]["short"], s["ttft_by_kind"]["long"]
    rate = s["tokens_by_kind"]["short"] / run["wall_s"]
    lines.append(f"| {label} | {run['loadavg_start'][0]} | {itl['p50_ms']} | {itl['p99_ms']} | {ttft['p50_ms']} | "
                 f"{ttft['p99_ms']} | {rate:.1f} | {long['p50_ms']} | {long['p99_ms']} |")
(here / "compare.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
