"""The longest waits between a stream's deltas in each run of run.sh, from the per-request
inter-token gaps in its results.json: the longest gap of the run, p99 over all gaps, the median
over requests of each request's longest gap, and how many gaps exceed 0.5 s. Writes stalls.md
beside the results.
    python docs/bench/chunked-prefill-burst/stalls.py [RESULTS_DIR]   # default round-between-prefills
"""

import sys
from pathlib import Path
from statistics import median

from trtssd.bench.records import percentile, read_result  # bench serve's own (numpy's linear interpolation)

here = Path(__file__).parent / (sys.argv[1] if len(sys.argv) > 1 else "round-between-prefills")
lines = ["| load | server | longest gap ms | ITL p99 ms | each request's longest, median ms | gaps > 0.5 s |",
         "|---|---|---:|---:|---:|---:|"]


def run_order(label: str) -> tuple[int, int]:
    """run.sh's order: before-1, after-1, after-2, before-2, before-3, ..."""
    kind, n = label.rsplit("-", 1)
    return (int(n) + 1) // 2, ["before1", "after1", "after0", "before0"].index(f"{kind}{int(n) % 2}")


labels = sorted((p.parent.name for p in here.glob("*/results.json*")), key=run_order)
runs = {label: read_result(here / label / "results.json")["runs"] for label in labels}
for level in [run["name"] for run in runs[labels[0]]]:
    for label in labels:
        run = next(r for r in runs[label] if r["name"] == level)
        gaps = [g for q in run["requests"] for g in q["itl_s"]]
        longest = [max(q["itl_s"]) for q in run["requests"] if q["itl_s"]]
        lines.append(f"| {level} | {label} | {max(gaps) * 1e3:.0f} | {percentile(gaps, 99) * 1e3:.0f} | "
                     f"{median(longest) * 1e3:.0f} | {sum(g > 0.5 for g in gaps)} |")
(here / "stalls.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
