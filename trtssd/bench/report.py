"""Comparisons between runs, the report (results.json, results.md) and its plots."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import psutil

from trtssd.bench.config import BenchConfig
from trtssd.bench.records import RunResult
from trtssd.spec_decode.speedup import Timings

log = logging.getLogger(__name__)


def attach_comparisons(runs: list[RunResult]) -> None:
    """Speedups over trtssd-ar and transformers' greedy on the same dataset, batch and temperature,
    and whether greedy outputs equal trtssd-ar's token for token."""
    by_cell: dict[tuple, dict[str, RunResult]] = {}
    for r in runs:
        if r.error is None:
            by_cell.setdefault((r.key.dataset, r.key.batch_size, r.key.temperature), {})[r.key.config] = r
    for cell in by_cell.values():
        for r in cell.values():
            for base in ("ar", "hf-greedy"):
                ref = cell.get(base)
                if ref is not None and ref.summary.get("tokens_per_s"):
                    r.summary[f"speedup_vs_{base}"] = round(r.summary["tokens_per_s"] / ref.summary["tokens_per_s"], 3)
            ar = cell.get("ar")
            if r.key.temperature == 0 and ar is not None and r is not ar:
                ref = {q.prompt_id: q.output_ids for q in ar.requests}
                same = [q.output_ids == ref.get(q.prompt_id) for q in r.requests]
                r.summary["same_tokens_as_ar"] = round(sum(same) / len(same), 4) if same else None


@dataclass
class BenchReport:
    machine: dict
    command: str
    config: dict
    runs: list[RunResult]
    timings: Timings | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"machine": self.machine, "command": self.command, "config": self.config, "notes": self.notes,
                "timings": self.timings.to_dict() if self.timings else None,
                "runs": [r.to_dict() for r in self.runs]}


def machine_info() -> dict:
    import importlib.metadata as md

    versions = {}
    for pkg in ("trtssd", "torch", "transformers", "numpy", "mpi4py", "gguf", "matplotlib"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu": cpu, "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": _memory_gib(), "versions": versions, "git_commit": _git_commit(),
        # Other processes compete for the cores: judge the numbers' noise by this.
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: Path | None, data: dict) -> None:
    """Write a script's results JSON (its directory made first); nothing when ``path`` is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    log.info("wrote %s", path)


def _memory_gib() -> float:
    return round(psutil.virtual_memory().total / 2**30, 1)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def config_dict(cfg: BenchConfig) -> dict:
    out = asdict(cfg)
    out["out_dir"] = str(cfg.out_dir)
    return out


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_markdown(report: BenchReport) -> str:
    m = report.machine
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if v)
    lines = [
        "# trtssd benchmark", "",
        f"- command: `{report.command}`",
        f"- machine: {m.get('cpu')} ({m.get('usable_cores')} usable cores of {m.get('cpu_count')}, "
        f"{m.get('memory_gib')} GiB), {m.get('platform')}; load average at the end {m.get('load_average_1m')}",
        f"- versions: python {m.get('python')}, {versions}; commit {m.get('git_commit')}",
        f"- run at {m.get('time_utc')}; {report.config.get('max_tokens')} output tokens per prompt"
        + (" (EOS ignored)" if report.config.get("ignore_eos") else ""),
    ]
    lines += [f"- {n}" for n in report.notes]
    lines += ["", "| system | dataset | batch | temp | tok/s | decode tok/s | vs ar | vs hf-greedy | TTFT p50 ms | "
              "per-token p50 ms | p99 ms | accept len | hit rate | overlap | same as ar |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report.runs:
        if r.error is not None:
            continue
        s = r.summary
        lines.append(
            f"| {r.key.config} | {r.key.dataset} | {r.key.batch_size} | {r.key.temperature:g} | "
            f"{_fmt(s.get('tokens_per_s'))} | {_fmt(s.get('decode_tokens_per_s'))} | "
            f"{_fmt(s.get('speedup_vs_ar'), 2)} | {_fmt(s.get('speedup_vs_hf-greedy'), 2)} | "
            f"{_fmt(s.get('ttft_p50_ms'))} | {_fmt(s.get('per_token_p50_ms'), 2)} | {_fmt(s.get('per_token_p99_ms'), 2)} | "
            f"{_fmt(_acceptance_length(r), 2)} | {_fmt(s.get('cache_hit_rate'), 2)} | "
            f"{_fmt(s.get('overlap_efficiency'), 2)} | {_fmt(s.get('same_tokens_as_ar'), 2)} |")
    per_pos = [r for r in report.runs if r.error is None and r.summary.get("acceptance_rate_per_position")]
    if per_pos:
        lines += ["", "Per-position acceptance (position 1..K):", ""]
        lines += [f"- {r.key.config}, {r.key.dataset}, batch {r.key.batch_size}, temp {r.key.temperature:g}: "
                  + ", ".join(f"{x:.2f}" for x in r.summary["acceptance_rate_per_position"]) for r in per_pos]
    lines += _structured_lines(report.runs)
    predicted = [r for r in report.runs if r.prediction]
    if predicted:
        lines += ["", "## Speedup model vs measurement", "",
                  (f"Component times: {report.timings.name}." if report.timings else ""),
                  "ar rows calibrate the per-step host overhead of their batch size (the ar runs' mean decode "
                  "step minus the target forward timed after the runs), so on average they match by construction, "
                  "unless that difference is negative: then the model uses 0 (results.json keeps the measured "
                  "value as overhead_measured_ms) and the ar rows' errors are the calibration's own. sd and ssd "
                  "rows are predictions from the measured forward costs and each run's own acceptance and hit "
                  "rate.", "",
                  "| system | dataset | batch | temp | a-derived tokens/round | h | predicted decode tok/s | "
                  "measured | error |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in predicted:
            p = r.prediction
            err = p.get("error")
            lines.append(f"| {r.key.config} | {r.key.dataset} | {r.key.batch_size} | {r.key.temperature:g} | "
                         f"{_fmt(p['tokens_per_round'], 2)} | {_fmt(p['hit_rate'], 2)} | {_fmt(p['tokens_per_s'])} | "
                         f"{_fmt(p.get('measured_decode_tokens_per_s'))} | "
                         f"{'-' if err is None else f'{err * 100:+.1f}%'}{' (calibration)' if p['calibration_only'] else ''} |")
    skipped = [r for r in report.runs if r.error is not None]
    if skipped:
        lines += ["", "## Not run", ""]
        seen = set()
        for r in skipped:
            line = f"- {r.key.config} (batch {r.key.batch_size}): {r.error}"
            if line not in seen:
                seen.add(line)
                lines.append(line)
    return "\n".join(lines) + "\n"


def _structured_lines(runs: Sequence[RunResult]) -> list[str]:
    """Valid answers and the grammar's forced proposals of the runs on structured-output sets."""
    rows = [r for r in runs if r.error is None and (r.summary.get("structured") or r.summary.get("grammar"))]
    if not rows:
        return []
    lines = ["", "## Structured outputs", "",
             "valid: answers that parse and follow their schema (jsonschema; a tool call's arguments against its "
             "function's parameters) of those checked; forced: grammar rounds, tokens the grammar proposed and "
             "those accepted (SpeculationMetrics.grammar_*), the accepted share of the output, and mask time.", "",
             "| system | dataset | batch | temp | valid / checked | grammar rounds | forced proposed | forced accepted "
             "| forced share | mask ms / token |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        checked, g = r.summary.get("structured") or {}, r.summary.get("grammar") or {}
        valid = f"{checked['valid']} / {checked['checked']}" if checked else "-"
        lines.append(f"| {r.key.config} | {r.key.dataset} | {r.key.batch_size} | {r.key.temperature:g} | {valid} | "
                     f"{_fmt(g.get('grammar_rounds'))} | {_fmt(g.get('grammar_proposed_tokens'))} | "
                     f"{_fmt(g.get('grammar_accepted_tokens'))} | {_fmt(g.get('forced_share'), 2)} | "
                     f"{_fmt(g.get('mask_ms_per_token'), 3)} |")
    return lines


def _acceptance_length(run: RunResult) -> float | None:
    if "mean_acceptance_length" in run.summary:
        return run.summary["mean_acceptance_length"]
    return run.summary.get("tokens_per_delivery") if run.key.system == "hf-assisted" else None


def write_plots(runs: Sequence[RunResult], out_dir: Path) -> list[Path]:
    """speedup_vs_batch.png and acceptance_by_dataset.png; returns the files written.

    Uses matplotlib's object API (no pyplot), so no global backend or figure state is touched.
    """
    from matplotlib.figure import Figure

    ok = [r for r in runs if r.error is None and r.summary.get("tokens_per_s")]
    written = []
    if ok:
        baseline = "hf-greedy" if any(r.key.system == "hf-greedy" for r in ok) else "ar"
        temps = sorted({r.key.temperature for r in ok})
        fig = Figure(figsize=(5.5 * len(temps), 4))
        for ax, temp in zip(fig.subplots(1, len(temps), squeeze=False)[0], temps):
            by_config = _throughput_by_batch(ok, temp)
            base = by_config.get(baseline, {})
            for config, points in sorted(by_config.items()):
                xs = [b for b in sorted(points) if b in base]
                if xs:
                    ax.plot(xs, [points[b] / base[b] for b in xs], marker="o", label=config)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xticks(sorted({r.key.batch_size for r in ok}))
            ax.set_xlabel("batch size")
            ax.set_ylabel(f"tokens/s relative to {baseline}")
            ax.set_title(f"temperature {temp:g} (all datasets)")
            ax.legend(fontsize=8)
        written.append(_save(fig, out_dir / "speedup_vs_batch.png"))
    spec = [r for r in ok if r.summary.get("mean_acceptance_length")]
    if spec:
        fig = Figure(figsize=(11, 4))
        axes = fig.subplots(1, 2)
        _grouped_bars(axes[0], spec, "mean_acceptance_length", "mean acceptance length (tokens/round)")
        _grouped_bars(axes[1], [r for r in spec if r.key.system == "ssd"], "cache_hit_rate", "cache hit rate (ssd)")
        written.append(_save(fig, out_dir / "acceptance_by_dataset.png"))
    return written


def _grouped_bars(ax, runs: Sequence[RunResult], metric: str, title: str) -> None:
    """One group of bars per dataset, one bar per configuration (mean over batch sizes)."""
    datasets = sorted({r.key.dataset for r in runs})
    label = lambda r: f"{r.key.config} T={r.key.temperature:g}"  # noqa: E731
    configs = sorted({label(r) for r in runs})
    width = 0.8 / max(len(configs), 1)
    for i, config in enumerate(configs):
        vals = [_mean([r.summary[metric] for r in runs if r.key.dataset == ds and label(r) == config])
                for ds in datasets]
        ax.bar(np.arange(len(datasets)) + i * width, vals, width, label=config)
    ax.set_xticks(np.arange(len(datasets)) + 0.4 - width / 2)
    ax.set_xticklabels(datasets)
    ax.set_title(title)
    if configs:
        ax.legend(fontsize=8)


def _throughput_by_batch(runs: Sequence[RunResult], temp: float) -> dict[str, dict[int, float]]:
    """config -> batch size -> tokens/s over every dataset together (total tokens / total time)."""
    tokens: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        if r.key.temperature == temp:
            t = tokens.setdefault(r.key.config, {}).setdefault(r.key.batch_size, [0.0, 0.0])
            t[0] += r.summary["output_tokens"]
            t[1] += r.summary["wall_s"]
    return {c: {b: n / s for b, (n, s) in bs.items() if s > 0} for c, bs in tokens.items()}


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_report(report: BenchReport, out_dir: Path, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "results.json", out_dir / "results.md"]
    files[0].write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    files[1].write_text(render_markdown(report))
    if plots:
        files += write_plots(report.runs, out_dir)
    return files
