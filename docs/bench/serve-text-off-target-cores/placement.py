"""Where the output processor runs, alone, in one server process: on the event loop's thread (as
trtssd serves) or on the loop thread between steps (where the text work ran before it left the
target's cores), switched between `trtssd bench serve` runs so that both placements share the
process, its speed and its warm-up. Runs of the two alternate (A B, B A, ...).

    .venv/bin/python docs/bench/serve-text-off-target-cores/placement.py OUT [--mode ar] [--blocks 4]
        [--concurrency 2]

Writes OUT/<placement>-<n>/ (bench serve's results) and OUT/results.jsonl (one line per run),
and prints the mean output tokens/s of each placement.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trtssd import LLM
from trtssd.serving.async_llm import AsyncLLM
from trtssd.serving.openai_server import OpenAIServer
from trtssd.serving.uvicorn_runner import BackgroundServer

log = logging.getLogger("placement")
PLACEMENTS = ("event-loop", "loop-thread")
_where = {"now": "event-loop"}
_shipped_deliver = AsyncLLM._deliver


def _deliver_on_the_loop_thread(self: AsyncLLM, outputs) -> None:
    """`AsyncLLM._deliver` with each stream's text work done here, the deltas handed over."""
    for out in outputs:
        stream = self._streams[out.seq_id]
        delta = stream._text.add(out)
        if delta is not None:
            if delta.stop_at is not None:
                self.loop.stop(out.seq_id)
            stream._call(stream._items.put_nowait, delta)
        if out.finished:
            self._ended(self.loop.pop_finished(out.seq_id))


def _deliver(self: AsyncLLM, outputs) -> None:
    if _where["now"] == "event-loop":
        _shipped_deliver(self, outputs)
    else:
        _deliver_on_the_loop_thread(self, outputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", default=None, help="the server's mode (default: trtssd's default)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--concurrency", default="2")
    parser.add_argument("--engine", default="engines/smollm2-135m-ggml")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    AsyncLLM._deliver = _deliver
    options = {"mode": args.mode} if args.mode else {}
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    # As run.sh serves the current tree: the two features the commit before the move lacked, off.
    with LLM(engine=args.engine, max_batch=16, prefix_cache_seqs=0, prefill_chunk=0, **options) as llm:
        with BackgroundServer(OpenAIServer(llm, "smollm2-135m")) as bg:
            time.sleep(30)  # the first seconds after a start decode slower here
            for block in range(args.blocks):
                order = PLACEMENTS if block % 2 == 0 else PLACEMENTS[::-1]
                for where in order:
                    _where["now"] = where
                    label = f"{where}-{block + 1}"
                    subprocess.run([sys.executable, "-m", "trtssd.cli", "bench", "serve", "--ignore-eos",
                                    "--label", label, "--out", str(args.out / label), "--base-url", bg.url,
                                    "--concurrency", args.concurrency, "--num-prompts", "16", "--max-tokens", "64",
                                    "--no-plots", "--log-level", "WARNING"], check=True, stdout=subprocess.DEVNULL)
                    report = json.loads((args.out / label / "results.json").read_text())
                    for run in report["runs"]:
                        s = run["summary"]
                        line = {"placement": where, "block": block + 1, "load": run["name"],
                                "output_tok_s": s["output_throughput"], "p99_itl_ms": s["p99_itl_ms"],
                                "failed": s["failed"], "loadavg_start": report["loadavg_start"]}
                        lines.append(line)
                        print(json.dumps(line), flush=True)
    (args.out / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for load in dict.fromkeys(x["load"] for x in lines):
        means = {w: statistics.fmean(x["output_tok_s"] for x in lines if x["placement"] == w and x["load"] == load)
                 for w in PLACEMENTS}
        print(f"{load}: " + ", ".join(f"{w} {m:.1f} tok/s" for w, m in means.items())
              + f"; loop-thread / event-loop {means['loop-thread'] / means['event-loop']:.3f}")


if __name__ == "__main__":
    main()
