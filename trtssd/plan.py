"""`trtssd plan`: what the speedup model predicts for ar, sd and ssd on given or measured timings.

The model itself (docs/algorithm.md section 8) is `trtssd.spec_decode.speedup`, which the draft
rank also runs live; this module reads timings (a file, flags or a measurement), searches K, fan-out
budget and backup per batch size, and prints a markdown table or JSON.

A target split over T ranks (``--tensor-parallel-size``) is one more forward cost curve: one
rank's forward of its 1/T shard plus the collectives every forward makes, two all-reduces of the
hidden state per decoder layer and one all-gather of the logits (trtssd/models/tensor_parallel.py
makes exactly these), each a cost curve over the forward's tokens (`TensorParallelCosts`). The
draft keeps its own device, so its curves are unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

from trtssd.bench.calibration import measure_timings
from trtssd.spec_decode.speedup import (DEFAULT_BUDGETS, DEFAULT_KS, CostCurve, Recommendation, Timings, Workload,
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


# --- a tensor-parallel target -------------------------------------------------------------------


@dataclass(frozen=True)
class TensorParallelCosts:
    """What a target split over ``size`` ranks costs per forward, beyond its ranks' own compute."""

    size: int  # target ranks T
    layers: int  # the target's decoder layers: two all-reduces each
    allreduce: CostCurve  # one all-reduce of the [tokens, hidden] state across the T ranks
    allgather: CostCurve | None = None  # the head's all-gather of [tokens, V/T] logits per rank (None: free)
    rank: CostCurve | None = None  # one rank's forward of its shard, collectives excluded (None: target / T)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 2:
            raise ValueError(f"tensor_parallel_size must be an integer >= 2 here; got {self.size!r}")
        if not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"--layers must be a positive integer (the target's decoder layers); got {self.layers!r}")

    def target(self, single: CostCurve) -> CostCurve:
        """The split target's forward cost from the unsplit one's (``single``, used only when no
        per-rank curve is given: an even split of its compute and weight reads)."""
        rank = self.rank or CostCurve(tuple((n, s / self.size) for n, s in single.points))
        parts = [rank, self.allreduce] + ([self.allgather] if self.allgather is not None else [])
        # Each part is piecewise linear with linear tails, so their sum is exact at the union of
        # their points (and linear past the last).
        tokens = sorted({n for part in parts for n, _ in part.points})
        return CostCurve(tuple((n, self.forward(n, rank)) for n in tokens))

    def forward(self, tokens: float, rank: CostCurve) -> float:
        gather = self.allgather(tokens) if self.allgather is not None else 0.0
        return rank(tokens) + 2 * self.layers * self.allreduce(tokens) + gather

    def apply(self, timings: Timings) -> Timings:
        what = "per-rank curve" if self.rank is not None else "target / T"
        return replace(timings, target=self.target(timings.target),
                       name=f"{timings.name}; target on {self.size} ranks ({what} + {2 * self.layers} all-reduces"
                            f"{' + 1 all-gather' if self.allgather is not None else ''} per forward)")

    def breakdown(self, single: CostCurve, tokens: float) -> dict[str, float]:
        """Seconds of one forward of ``tokens`` tokens, by part (for the report)."""
        rank = self.rank or CostCurve(tuple((n, s / self.size) for n, s in single.points))
        return {"rank_s": rank(tokens), "allreduces_s": 2 * self.layers * self.allreduce(tokens),
                "allgather_s": self.allgather(tokens) if self.allgather is not None else 0.0}


def load_collectives(path: str | Path) -> dict:
    """A collectives measurement (docs/bench/tensor-parallel-collectives/run.sh writes one): its
    ranks and its all-reduce and all-gather curves."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read the collectives file {path}: {err}") from None
    if not isinstance(data, Mapping) or "allreduce" not in data or "size" not in data:
        raise ValueError(f"{path} must hold a JSON object with 'size' and 'allreduce' (and optionally 'allgather')")
    return {"size": data["size"], "allreduce": CostCurve.from_mapping(data["allreduce"], f"{path}: allreduce"),
            "allgather": (CostCurve.from_mapping(data["allgather"], f"{path}: allgather")
                          if data.get("allgather") else None)}


def _tensor_parallel_from_args(args: argparse.Namespace) -> TensorParallelCosts | None:
    given = [flag for flag in ("layers", "rank_cost", "allreduce_cost", "allgather_cost", "collectives")
             if getattr(args, flag) is not None]
    if args.tensor_parallel_size == 1:
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --tensor-parallel-size > 1")
        return None
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1; got {args.tensor_parallel_size}")
    measured = load_collectives(args.collectives) if args.collectives else {}
    if measured and measured["size"] != args.tensor_parallel_size:
        raise ValueError(f"{args.collectives} measured {measured['size']} ranks, not --tensor-parallel-size "
                         f"{args.tensor_parallel_size}")
    allreduce = (CostCurve.parse(args.allreduce_cost, "--allreduce-cost") if args.allreduce_cost
                 else measured.get("allreduce"))
    if allreduce is None:
        raise ValueError("--tensor-parallel-size > 1 needs --allreduce-cost or --collectives (what one all-reduce "
                         "of the hidden state costs across the ranks)")
    if args.layers is None:
        raise ValueError("--tensor-parallel-size > 1 needs --layers (the target's decoder layers)")
    allgather = (CostCurve.parse(args.allgather_cost, "--allgather-cost") if args.allgather_cost
                 else measured.get("allgather"))
    rank = CostCurve.parse(args.rank_cost, "--rank-cost") if args.rank_cost else None
    return TensorParallelCosts(args.tensor_parallel_size, args.layers, allreduce, allgather, rank)


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
    tp = p.add_argument_group("a tensor-parallel target (the draft keeps its own device)")
    tp.add_argument("--tensor-parallel-size", type=int, default=1, help="target ranks T (default 1); with T > 1 a "
                    "target forward costs one rank's forward plus 2 all-reduces per layer and one all-gather")
    tp.add_argument("--layers", type=int, help="the target's decoder layers (with T > 1)")
    tp.add_argument("--rank-cost", help="one rank's forward of its 1/T shard 'tokens:seconds,...' (default: the "
                    "target cost / T)")
    tp.add_argument("--allreduce-cost", help="one all-reduce of the [tokens, hidden] state across the T ranks "
                    "'tokens:seconds,...'")
    tp.add_argument("--allgather-cost", help="the head's all-gather of the logits across the T ranks "
                    "'tokens:seconds,...' (default: none)")
    tp.add_argument("--collectives", help="all-reduce and all-gather curves measured by "
                    "docs/bench/tensor-parallel-collectives/run.sh (flags override it)")
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
        split = _tensor_parallel_from_args(args)
        single = timings.target
        if split is not None:
            timings = split.apply(timings)
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
        if split is not None:
            parts = split.breakdown(single, 1)
            sys.stdout.write(f"tensor-parallel target, one-token forward: rank {parts['rank_s'] * 1e3:.3f} ms + "
                             f"all-reduces {parts['allreduces_s'] * 1e3:.3f} ms + all-gather "
                             f"{parts['allgather_s'] * 1e3:.3f} ms = {timings.target(1) * 1e3:.3f} ms\n\n")
        sys.stdout.write(format_recommendations(recs, timings, workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
