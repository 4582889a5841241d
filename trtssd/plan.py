"""`trtssd plan`: what the speedup model predicts for ar, sd and ssd on given or measured timings.

The model itself (docs/algorithm.md section 8) is `trtssd.runtime.speedup_model`, which the draft
rank also runs live; this module reads timings (a file, flags or a measurement), searches K, fan-out
budget and backup per batch size, and prints a markdown table or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Mapping, Sequence

from trtssd.bench.calibration import measure_timings
from trtssd.runtime.speedup_model import (DEFAULT_BUDGETS, DEFAULT_KS, CostCurve, Recommendation, Timings, Workload,
                                          acceptance_from_length, recommend)


# --- timings -------------------------------------------------------------------------------------


def load_timings(path: str | Path) -> Timings:
    """Timings from a JSON or YAML file (see docs/benchmarks.md for the format)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"timings file not found: {path}")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, Mapping):
        raise ValueError(f"timings file {path} must hold a mapping at the top level")
    # A results.json from `trtssd bench` carries its calibration under "timings".
    if "timings" in data and "target" not in data:
        data = data["timings"]
        if not isinstance(data, Mapping):
            raise ValueError(f"{path} holds no calibrated timings (was the benchmark run with --no-calibrate?)")
    return Timings.from_dict(data)


# --- presentation --------------------------------------------------------------------------------


def format_recommendations(recs: Sequence[Recommendation], timings: Timings, workload: Workload) -> str:
    """A markdown report: the best configuration of each mode per batch size."""
    lines = [
        f"timings: {timings.name}; acceptance a={workload.acceptance:.3f}, "
        + (f"hit rate h={workload.hit_rate:.3f}" if workload.hit_rate is not None
           else f"hit rate from fan-out (r={workload.r}, c={workload.c})"),
        "",
        "| batch | mode | K | budget | fan-out | h | tokens/round | round ms | tokens/s | vs ar | draft hidden |",
        "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for rec in recs:
        base = rec.ar.tokens_per_s
        best_fast = max((c for c in rec.candidates if c.mode == "ssd-fast"), key=lambda p: p.tokens_per_s)
        best_neural = max((c for c in rec.candidates if c.mode == "ssd-neural"), key=lambda p: p.tokens_per_s)
        for p in (rec.ar, rec.sd, best_neural, best_fast):
            row = p.to_dict()
            lines.append(
                f"| {p.batch_size} | {p.mode} | {_cell(p.k)} | {_cell(p.budget)} | "
                f"{_cell(','.join(map(str, p.fanout)) if p.fanout else None)} | {_cell(row['hit_rate'])} | "
                f"{p.tokens_per_round:.2f} | {p.round_time_s * 1e3:.2f} | {p.tokens_per_s:.1f} | "
                f"{p.tokens_per_s / base:.2f}x | {_cell(p.draft_fits)} |"
            )
    lines.append("")
    for rec in recs:
        s = rec.ssd
        best = rec.best
        verdict = "use ssd" if best is s else f"fastest is {best.mode}" + (f" K={best.k}" if best.k else "")
        lines.append(
            f"batch {rec.batch_size}: {verdict}; best ssd: K={s.k}, fanout_budget={s.budget}, backup={s.mode[4:]} "
            f"({s.tokens_per_s:.1f} tok/s, {rec.ssd_speedup_over_ar:.2f}x ar, {rec.ssd_speedup_over_sd:.2f}x sd "
            f"at K={rec.sd.k})"
        )
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    return "-" if value is None else str(value)


# --- command line --------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    """'1-8' or '2,4,6'."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            return tuple(range(lo, hi + 1))
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'LO-HI' or a comma-separated list of ints; got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtssd plan", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("timings (a file, flags, or --measure; flags override the file)")
    src.add_argument("--timings", help="JSON/YAML timings file, or a results.json from `trtssd bench`")
    src.add_argument("--measure", action="store_true", help="calibrate the engine's models on this machine")
    src.add_argument("--engine", default=None, help="engine directory for --measure (default: the embedded one)")
    src.add_argument("--target", default=None, help="--measure this target model path instead of an engine")
    src.add_argument("--draft", default=None, help="--measure this draft model path (with --target)")
    src.add_argument("--target-cost", help="target forward cost 'tokens:seconds,...'")
    src.add_argument("--draft-cost", help="draft forward cost 'tokens:seconds,...'")
    src.add_argument("--tree-cost", help="draft tree-step cost 'tokens:seconds,...' (default: the draft's)")
    src.add_argument("--handshake-s", type=float, help="target<->draft exchange per round")
    src.add_argument("--overhead-s", type=float, help="target host work per round")
    src.add_argument("--fast-backup-s", type=float, help="fast backup proposal per missed row")
    src.add_argument("--save-timings", help="write the timings used to this JSON file")
    wl = p.add_argument_group("workload")
    wl.add_argument("--acceptance", type=float, default=0.7, help="per-position acceptance a (default 0.7)")
    wl.add_argument("--mean-acceptance-length", type=float, help="measured tokens/round at --measured-k; sets a")
    wl.add_argument("--measured-k", type=int, default=5, help="K of --mean-acceptance-length (default 5)")
    wl.add_argument("--hit-rate", type=float, help="cache hit rate h (default: predicted from the fan-out)")
    wl.add_argument("--r", type=float, default=1.0, help="miss power-law exponent (default 1)")
    wl.add_argument("--c", type=float, default=0.5, help="miss rate with one candidate (default 0.5)")
    wl.add_argument("--fast-acceptance", type=float, default=0.0, help="acceptance of fast-backup proposals")
    sw = p.add_argument_group("search")
    sw.add_argument("--batch", type=_int_list, default=(1,), help="batch sizes, e.g. '1,2,4,8' or '1-8'")
    sw.add_argument("--k", type=_int_list, default=DEFAULT_KS, help="lookaheads to search (default 1-8)")
    sw.add_argument("--budgets", type=_int_list, default=DEFAULT_BUDGETS, help="fan-out budgets to search")
    p.add_argument("--json", action="store_true", help="print every evaluated configuration as JSON")
    return p


def _timings_from_args(args: argparse.Namespace) -> Timings:
    base: Timings | None = None
    if args.timings:
        base = load_timings(args.timings)
    elif args.measure:
        base = measure_timings(args.engine, args.target, args.draft, batch_sizes=args.batch, ks=args.k,
                               budgets=args.budgets)
    updates = {}
    for flag, name in (("target_cost", "target"), ("draft_cost", "draft"), ("tree_cost", "tree")):
        if getattr(args, flag):
            updates[name] = CostCurve.parse(getattr(args, flag), f"--{flag.replace('_', '-')}")
    for name in ("handshake_s", "overhead_s", "fast_backup_s"):
        if getattr(args, name) is not None:
            updates[name] = getattr(args, name)
    if base is None:
        missing = [f"--{n}-cost" for n in ("target", "draft") if n not in updates]
        if missing:
            raise ValueError(f"give --timings FILE, --measure, or both {' and '.join(missing)}")
        return Timings(name="command line", **updates)
    return replace(base, **updates, name=base.name + (" + flags" if updates else ""))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        timings = _timings_from_args(args)
        a = args.acceptance
        if args.mean_acceptance_length is not None:
            a = acceptance_from_length(args.mean_acceptance_length, args.measured_k)
        workload = Workload(a, args.hit_rate, args.r, args.c, args.fast_acceptance)
        recs = [recommend(timings, workload, b, args.k, args.budgets) for b in args.batch]
    except ValueError as err:
        parser.error(str(err))
        return 2
    if args.save_timings:
        Path(args.save_timings).write_text(json.dumps(timings.to_dict(), indent=1) + "\n")
    if args.json:
        payload = {"timings": timings.to_dict(), "workload": asdict(workload),
                   "batches": [{"batch_size": r.batch_size, "best": {m: getattr(r, m).to_dict() for m in
                                                                    ("ar", "sd", "ssd")},
                                "candidates": [c.to_dict() for c in r.candidates]} for r in recs]}
        sys.stdout.write(json.dumps(payload, indent=1) + "\n")
    else:
        sys.stdout.write(format_recommendations(recs, timings, workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
