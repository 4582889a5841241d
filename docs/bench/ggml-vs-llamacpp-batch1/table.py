"""The README's and docs/benchmarks.md's tables, read from the results run.sh wrote beside this file.

Usage: python docs/bench/ggml-vs-llamacpp-batch1/table.py   (prints markdown tables per engine:
greedy, then temperature 0.8)
"""

from __future__ import annotations

import json
from pathlib import Path

from trtssd.bench.records import read_result

HERE = Path(__file__).resolve().parent
DATASETS = ("humaneval", "chat", "math")
# (label, layout folder, system as results.json names it), in the order the tables show them.
ROWS = (
    ("trtssd ar, both cores (exact rows)", "one-core-per-rank", "ar"),
    ("trtssd ar, both cores (`lend_draft_cores=\"always\"`)", "two-threads", "ar"),
    ("llama.cpp, 2 threads", "two-threads", "llama.cpp"),
    ("transformers `generate`, 2 threads", "two-threads", "hf-greedy"),
    ("transformers assisted generation, 2 threads", "two-threads", "hf-assisted"),
    ("trtssd sd, 1 core per rank", "one-core-per-rank", "sd"),
    ("trtssd ssd, 1 core per rank", "one-core-per-rank", "ssd"),
    ("trtssd auto (ssd under load control)", "one-core-per-rank", "auto"),
    ("llama.cpp, 1 thread", "one-core-per-rank", "llama.cpp"),
    ("llama.cpp sd, 1 + 1 threads", "one-core-per-rank", "llama.cpp-sd"),
)
TEMPERATURES = (0.0, 0.8)


def rates(engine: str, layout: str) -> dict[tuple[str, str, float], float]:
    """(system, dataset, temperature) -> tokens/s including prefill."""
    path = HERE / engine / layout / "results.json"
    if not (path.is_file() or path.with_name("results.json.gz").is_file()):
        return {}
    runs = read_result(path)["runs"]
    return {(r["key"]["system"], r["key"]["dataset"], r["key"]["temperature"]): r["summary"]["tokens_per_s"]
            for r in runs if r["error"] is None}


def table(engine: str, temperature: float) -> str:
    by_layout = {layout: rates(engine, layout) for layout in ("one-core-per-rank", "two-threads")}
    lines = ["| system | HumanEval | chat | math |", "|---|---:|---:|---:|"]
    for label, layout, system in ROWS:
        values = [by_layout[layout].get((system, d, temperature)) for d in DATASETS]
        if any(v is not None for v in values):
            cells = " | ".join("-" if v is None else f"{v:.1f}" for v in values)
            lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    for engine in sorted(p.name for p in HERE.iterdir() if p.is_dir()):
        for temperature in TEMPERATURES:
            print(f"{engine}, temperature {temperature}:\n\n{table(engine, temperature)}\n")


if __name__ == "__main__":
    main()
