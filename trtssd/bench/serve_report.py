"""Files of `trtssd bench serve`: results.json, results.md, serve.png; and the --compare side by side.

Everything here works on the JSON form of a report (ServeReport.to_dict()), so a comparison reads
earlier runs' results.json exactly as a fresh run writes it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

from trtssd.bench.records import read_result

log = logging.getLogger(__name__)

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _spec(run: dict, key: str):
    return (run.get("spec") or {}).get(key)


def _stat_keys(report: dict) -> list[str]:
    """'median' plus 'p99' etc. and 'max', the columns each latency gets besides the mean."""
    qs = report.get("config", {}).get("percentiles") or [99]
    return ["median"] + [f"p{int(q) if float(q).is_integer() else q}" for q in qs] + ["max"]


# --- one report ----------------------------------------------------------------------------------


def render_markdown(report: dict) -> str:
    cfg, m = report["config"], report["machine"]
    lines = [
        f"# Serving benchmark: {report['label']}", "",
        f"- command: `{report['command']}`",
        f"- server: {report['base_url']}{report['endpoint']}, model `{report['model']}`",
        f"- {cfg['num_prompts']} requests per run from {', '.join(cfg['datasets'])}; max_tokens {cfg['max_tokens']}"
        + (" (EOS ignored)" if cfg["ignore_eos"] else "") + f", temperature {cfg['temperature']:g}, seed {cfg['seed']}",
        f"- client machine: {m.get('cpu')} ({m.get('usable_cores')} usable cores); load average (1, 5, 15 min) "
        f"{_loadavg(report['loadavg_start'])} at the start, {_loadavg(report['loadavg_end'])} at the end",
    ]
    if any(r["summary"].get("tokens_from_usage") is False for r in report["runs"]):
        lines.append("- **the server sent no usage chunk: output tokens are counted as chunks and undercount "
                     "a speculative server**")
    lines += ["", "## Throughput", "",
              "| load | completed | failed | duration s | req/s | output tok/s | total tok/s | accept len "
              "| acceptance rate | cache hit rate |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        s = run["summary"]
        lines.append(f"| {run['name']} | {s['completed']} | {s['failed']} | {_fmt(s['duration_s'], 2)} | "
                     f"{_fmt(s['request_throughput'], 2)} | {_fmt(s['output_throughput'])} | "
                     f"{_fmt(s['total_token_throughput'])} | {_fmt(_spec(run, 'mean_acceptance_length'), 2)} | "
                     f"{_fmt(_spec(run, 'acceptance_rate'), 2)} | {_fmt(_spec(run, 'cache_hit_rate'), 2)} |")
    stats = ["mean"] + _stat_keys(report)
    head = [f"{short} {'p50' if st == 'median' else st}" for _, short in LATENCIES for st in stats]
    lines += ["", "## Latency (ms)", "", "TTFT: to the first token; TPOT: (E2E - TTFT) / (output tokens - 1); "
              "ITL: between streamed chunks (a chunk may hold several tokens); E2E: to `data: [DONE]`; max: the "
              "longest of the run (- where a results file has none).", "",
              "| load | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for run in report["runs"]:
        s = run["summary"]
        lines.append(f"| {run['name']} | " + " | ".join(_fmt(s.get(f"{st}_{key}_ms"))
                                                        for key, _ in LATENCIES for st in stats) + " |")
    lines += structured_lines(report["runs"])
    errors = [(run["name"], msg, n) for run in report["runs"] for msg, n in run["summary"]["errors"].items()]
    if errors:
        lines += ["", "## Failed requests", ""] + [f"- {name}: {n} x {msg}" for name, msg, n in errors]
    return "\n".join(lines) + "\n"


def structured_lines(runs: Sequence[dict]) -> list[str]:
    """The structured-outputs table: valid answers where a schema was given, and the server's
    grammar-forced tokens (its trtssd:structured_output_* counters; - where it has none)."""
    if not any(run["summary"].get("structured") or _spec(run, "forced_tokens") is not None for run in runs):
        return []
    lines = ["", "## Structured outputs", "",
             "valid: answers that parse and follow their schema (jsonschema; a tool call's arguments against its "
             "function's parameters) of those checked; forced: tokens the grammar proposed (the server's "
             "`trtssd:structured_output_*` counters), their acceptance, and the target's mask time per output token.",
             "", "| load | valid / checked | forced rounds | forced tokens | forced share | forced acceptance "
             "| mask ms / token |", "|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        s, checked = run["summary"], run["summary"].get("structured") or {}
        out_tokens = s.get("total_output_tokens") or 0
        forced, mask = _spec(run, "forced_tokens"), _spec(run, "mask_seconds")
        share = forced / out_tokens if forced is not None and out_tokens else None
        mask_ms = mask * 1e3 / out_tokens if mask is not None and out_tokens else None
        valid = f"{checked['valid']} / {checked['checked']}" if checked else "-"
        lines.append(f"| {run['name']} | {valid} | {_fmt(_spec(run, 'forced_rounds'), 0)} | {_fmt(forced, 0)} | "
                     f"{_fmt(share, 2)} | {_fmt(_spec(run, 'forced_acceptance_rate'), 2)} | {_fmt(mask_ms, 3)} |")
    reasons = [(run["name"], why, n) for run in runs
               for why, n in ((run["summary"].get("structured") or {}).get("invalid_reasons") or {}).items()]
    if reasons:
        lines += ["", "Invalid answers:", ""] + [f"- {name}: {n} x {why}" for name, why, n in reasons]
    return lines


def _loadavg(values: Sequence[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in values) if values else "-"


def write_report(report, out_dir: Path, plots: bool = True) -> list[Path]:
    """results.json, results.md and (with plots) serve.png; returns the files written."""
    data = report.to_dict()
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "results.json", out_dir / "results.md"]
    files[0].write_text(json.dumps(data, indent=1) + "\n")
    files[1].write_text(render_markdown(data))
    if plots:
        files.append(write_plot({data["label"]: data["runs"]}, out_dir / "serve.png"))
    return files


# --- plots ---------------------------------------------------------------------------------------


def x_axis(runs: Sequence[dict]) -> tuple[str, str]:
    """Plot against concurrency unless the sweep is over request rates at one (or no) cap."""
    concurrencies = {r["concurrency"] for r in runs}
    rates = {r["request_rate"] for r in runs}
    if None not in concurrencies and (len(concurrencies) > 1 or rates == {None}):
        return "concurrency", "concurrency (requests in flight)"
    return "request_rate", "request rate (requests/s)"


def write_plot(series: dict[str, list[dict]], path: Path) -> Path:
    """Output throughput, and p50 (solid) / p99 (dashed) TTFT, TPOT, ITL and E2E, vs load; one colour per label.

    Uses matplotlib's object API with the Agg canvas: no pyplot, no display, no global state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [r for rs in series.values() for r in rs]
    key, xlabel = x_axis(runs)
    fig = Figure(figsize=(15, 8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).flatten()
    for i, (label, label_runs) in enumerate(series.items()):
        color = f"C{i}"
        points = sorted((r for r in label_runs if r[key] is not None), key=lambda r: r[key])
        xs = [r[key] for r in points]
        axes[0].plot(xs, _values(r["summary"].get("output_throughput") for r in points), "o-", color=color,
                     label=label)
        for ax, (metric, short) in zip(axes[1:5], LATENCIES):
            ax.plot(xs, _values(r["summary"].get(f"median_{metric}_ms") for r in points), "o-", color=color,
                    label=f"{label} p50")
            ax.plot(xs, _values(r["summary"].get(f"p99_{metric}_ms") for r in points), "s--", color=color,
                    label=f"{label} p99")
            ax.set_title(f"{short} (ms)")
        accept = _values(_spec(r, "mean_acceptance_length") for r in points)
        if any(a == a for a in accept):  # not all NaN: the server exposes vLLM's spec-decode counters
            axes[5].plot(xs, accept, "o-", color=color, label=label)
    axes[0].set_title("output throughput (tokens/s)")
    axes[5].set_title("mean acceptance length (from /metrics)")
    if not axes[5].has_data():
        axes[5].text(0.5, 0.5, "no vllm:spec_decode_* counters on /metrics", ha="center", transform=axes[5].transAxes)
    for ax in axes:
        ax.set_xlabel(xlabel)
        if ax.has_data():
            ax.set_ylim(bottom=0)  # from zero, so a small difference does not look like a large one
        if key == "concurrency":
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r[key] for r in runs}), [str(c) for c in sorted({r[key] for r in runs})])
        if ax.has_data():
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _values(values) -> list[float]:
    """None (no completed request, no such metric) as NaN, which matplotlib leaves out of the line."""
    return [float("nan") if v is None else float(v) for v in values]


# --- comparison ----------------------------------------------------------------------------------


def load_reports(dirs: Sequence[Path]) -> list[dict]:
    """results.json (or results.json.gz, as docs/bench keeps large ones) of each directory; labels
    made unique with the directory name when they clash."""
    reports = []
    for d in dirs:
        path = d / "results.json" if d.is_dir() else d
        try:
            reports.append(read_result(path))
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read a serving benchmark result from {path}: {err}") from None
    labels = [r["label"] for r in reports]
    for r, d in zip(reports, dirs):
        if labels.count(r["label"]) > 1:
            r["label"] = f"{r['label']} ({d.name})"
    return reports


def render_comparison(reports: Sequence[dict]) -> str:
    labels = [r["label"] for r in reports]
    loads = _loads_in_order(reports)
    by = {(r["label"], run["name"]): run for r in reports for run in r["runs"]}
    base = labels[0]
    lines = ["# Serving benchmark comparison", ""]
    lines += [f"- {r['label']}: `{r['command']}` (model `{r['model']}` at {r['base_url']}; load average "
              f"{_loadavg(r['loadavg_start'])} -> {_loadavg(r['loadavg_end'])})" for r in reports]
    ratio_head = [f"{lab} / {base}" for lab in labels[1:]]
    lines += ["", "## Output throughput (tokens/s)", "",
              "| load | " + " | ".join(labels + ratio_head) + " |", "|---|" + "---:|" * (len(labels) + len(ratio_head))]
    for name in loads:
        tput = [_tput(by.get((lab, name))) for lab in labels]
        ratios = [_fmt(t / tput[0], 2) + "x" if t is not None and tput[0] else "-" for t in tput[1:]]
        lines.append(f"| {name} | " + " | ".join([_fmt(t) for t in tput] + ratios) + " |")
    compared = ("median", "p99", "max")
    head = [f"{short} {'p50' if st == 'median' else st}" for _, short in LATENCIES for st in compared]
    lines += ["", "## Latency (ms) and speculation", "",
              "| load | server | completed | failed | " + " | ".join(head) + " | accept len | cache hit rate |",
              "|---|---|---:|---:|" + "---:|" * (len(head) + 2)]
    for name in loads:
        for lab in labels:
            run = by.get((lab, name))
            if run is None:
                continue
            s = run["summary"]
            cells = [_fmt(s.get(f"{st}_{key}_ms")) for key, _ in LATENCIES for st in compared]
            lines.append(f"| {name} | {lab} | {s['completed']} | {s['failed']} | " + " | ".join(cells)
                         + f" | {_fmt(_spec(run, 'mean_acceptance_length'), 2)} | "
                         f"{_fmt(_spec(run, 'cache_hit_rate'), 2)} |")
    return "\n".join(lines) + "\n"


def _tput(run: dict | None) -> float | None:
    return None if run is None else run["summary"]["output_throughput"]


def _loads_in_order(reports: Sequence[dict]) -> list[str]:
    names: list[str] = []
    for r in reports:
        names += [run["name"] for run in r["runs"] if run["name"] not in names]
    return names


def write_comparison(dirs: Sequence[Path], out_dir: Path, plots: bool = True) -> list[Path]:
    """compare.json (the runs' summaries by label), compare.md and (with plots) compare.png."""
    if len(dirs) < 2:
        raise ValueError("--compare needs at least two result directories")
    reports = load_reports(dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    merged = {"sources": [{"label": r["label"], "dir": str(d), "command": r["command"], "model": r["model"],
                           "loadavg_start": r["loadavg_start"], "loadavg_end": r["loadavg_end"]}
                          for r, d in zip(reports, dirs)],
              "runs": {r["label"]: [{k: v for k, v in run.items() if k != "requests"} for run in r["runs"]]
                       for r in reports}}
    files = [out_dir / "compare.json", out_dir / "compare.md"]
    files[0].write_text(json.dumps(merged, indent=1) + "\n")
    files[1].write_text(render_comparison(reports))
    if plots:
        files.append(write_plot({r["label"]: r["runs"] for r in reports}, out_dir / "compare.png"))
    return files
