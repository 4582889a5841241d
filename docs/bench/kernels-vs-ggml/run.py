"""Each engine side's forwards on the torch backend (our CPU kernels) next to the same model on
ggml (llama.cpp's kernels, the GGUF file as it is), one thread each, one process at a time.

The torch engines run what trtssd wrote by hand: the default engine's int4 self-draft with
compiled few-row layers (trtssd/kernels/draft_layers.cpp), the Qwen pair's int8 projections
(fbgemm) with the same compiled layers on its draft; the default engine's target is fp32. The
ggml engines run the GGUF files on llama.cpp. A forward of R rows is one sequence's chain of R
tokens after a 128-token prefix (what a verify or a glue costs); a tree step of B branches is the
middle step of a K-deep tree (what SSD's pre-speculation costs, per step).

    .venv/bin/python docs/bench/kernels-vs-ggml/run.py           # writes results.json and results.md here
    .venv/bin/python docs/bench/kernels-vs-ggml/run.py --table   # results.md again from results.json

Run on a quiet machine: each side is timed on one core, as a rank runs it.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from pathlib import Path

from trtssd.backends.loading import load_side
from trtssd.bench.report import machine_info
from trtssd.models.engine_dir import engine_speculation, load_manifest
from trtssd.cores import pin
from trtssd.runtime.calibration import time_forwards, time_tree_steps

log = logging.getLogger("kernels-vs-ggml")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
ENGINES = {"default engine (SmolLM2-135M)": ("smollm2-135m", "smollm2-135m-ggml"),
           "Qwen2.5-Coder 1.5B / 0.5B": ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-ggml")}
MAX_ROWS = 64


def time_side(engine_dir: Path, side: str) -> dict:
    manifest = load_manifest(engine_dir)
    k = int(engine_speculation(engine_dir).get("k", 5))
    executor = load_side(engine_dir, side, max_seqs=2, max_seq_len=1024, row_invariant=side == "target")
    try:
        out = {"backend": manifest[side]["backend"], "execution": manifest[side].get("execution", manifest[side].get("weights", "")),
               "chain_s": time_forwards(executor, MAX_ROWS, context=128, repeats=5)}
        if side == "draft":
            out["tree_k"] = k
            out["tree_s"] = time_tree_steps(executor, k, MAX_ROWS, context=128, repeats=5)
        return out
    finally:
        close = getattr(executor, "close", None)
        if close:
            close()


def table(results: dict) -> str:
    lines = ["| engine | side | forward | rows | torch (ms) | ggml (ms) | torch / ggml |", "|---|---|---|---:|---:|---:|---:|"]
    for engine, sides in results["engines"].items():
        for side, by_backend in sides.items():
            torch_side, ggml_side = by_backend["torch"], by_backend["ggml"]
            for kind in ("chain_s", "tree_s"):
                if kind not in torch_side:
                    continue
                for rows in torch_side[kind]:
                    t, g = torch_side[kind][rows], ggml_side[kind].get(rows)
                    if g is None:
                        continue
                    name = "chain" if kind == "chain_s" else f"tree step (K={torch_side['tree_k']})"
                    lines.append(f"| {engine} | {side} ({torch_side['backend']}) | {name} | {rows} | "
                                 f"{1000 * t:.1f} | {1000 * g:.1f} | {t / g:.2f} |")
    return "\n".join(lines)


def write_table(results: dict) -> str:
    load = ", ".join(f"{x:.2f}" for x in results["load_average_at_start"])
    end = ", ".join(f"{x:.2f}" for x in results["load_average_at_end"])
    md = "\n".join(["# Our CPU kernels (torch engines) next to ggml, one thread", "",
                    f"`{results['command']}` on {results['machine'].get('cpu', platform.machine())}, "
                    f"load average {load} at start, {end} at end.", "", table(results), ""])
    (HERE / "results.md").write_text(md)
    return md


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if sys.argv[1:] == ["--table"]:
        print(write_table(json.loads((HERE / "results.json").read_text())))
        return 0
    pin("kernels-vs-ggml", [0], 1)  # one core, one thread: a rank's share
    results = {"command": "python docs/bench/kernels-vs-ggml/run.py", "machine": machine_info(),
               "load_average_at_start": os.getloadavg(), "engines": {}}
    for engine, (torch_dir, ggml_dir) in ENGINES.items():
        sides = results["engines"].setdefault(engine, {})
        for side in ("target", "draft"):
            for backend, name in (("torch", torch_dir), ("ggml", ggml_dir)):
                log.info("%s %s on %s", engine, side, backend)
                sides.setdefault(side, {})[backend] = time_side(ROOT / "engines" / name, side)
    results["load_average_at_end"] = os.getloadavg()
    (HERE / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(write_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
