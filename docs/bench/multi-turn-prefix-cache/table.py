"""compare.md from the runs beside this file: time to first token by turn, and over turns 3-8."""

import statistics
import sys
from pathlib import Path

from trtssd.bench.records import read_result

here = Path(__file__).parent
labels = sys.argv[1:] or ["cache-off-1", "cache-on-1", "cache-off-2", "cache-on-2"]
runs = {label: read_result(here / label / "result.json") for label in labels}
lines = ["# Multi-turn chat: time to first token with and without prefix caching", "",
         "`bash docs/bench/multi-turn-prefix-cache/run.sh`; p50 over the sessions, ms.", "",
         "| run | load avg at start | " + " | ".join(f"turn {t}" for t in range(1, 9)) + " | turns 3-8 p50 | turns 3-8 p99 |",
         "|---|---|" + "---:|" * 10]
for label, run in runs.items():
    by_turn = run["summary"]["ttft_by_kind"]
    late = sorted(r["ttft_s"] for r in run["requests"] if r["kind"] in {f"turn {t}" for t in range(3, 9)})
    p99 = late[min(len(late) - 1, int(0.99 * len(late)))]
    lines.append(f"| {label} | {run['loadavg_start'][0]} | "
                 + " | ".join(f"{by_turn[f'turn {t}']['p50_ms']:.0f}" for t in range(1, 9))
                 + f" | {1000 * statistics.median(late):.0f} | {1000 * p99:.0f} |")
(here / "compare.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
