"""Benchmark harness: trtssd's ar / sd / ssd next to transformers (and llama.cpp) on the same prompts.

    trtssd bench                              # --quick: 4 prompts per set x 64 tokens, batch 1, greedy
    trtssd bench --full --out bench-out       # batch 1,2,4,8, temperature 0 and 0.8
    trtssd bench --systems ssd,hf-greedy --datasets my_prompts.jsonl --k 3,5,7 --budget 6,12

Every system sees the same token ids (prompts are tokenized once, chat sets through the model's
chat template) and, by default, generates exactly ``max_tokens`` tokens (EOS ignored), so tokens/s
compare like with like. Each trtssd configuration runs in its own ``LLM``, closed before the
next. After the runs the harness times the models' forward passes on this machine
(``measure_timings``) and checks the speedup model (trtssd.spec_decode.speedup) against what it
measured.

Writes results.json, results.md and PNG plots to the output directory.

Modules: ``prompts`` (prompt sets), ``records`` (what a run records), ``config`` (what to run),
``runners`` (one per loaded system), ``sweep`` (running it all), ``calibration`` (forward timings
and the speedup model's predictions), ``report`` (results files and plots), ``cli``.
"""

from trtssd.bench.calibration import (
                                  compare_with_plan,
                                  measure_timings,
                                  workload_from_summary,
)
from trtssd.bench.cli import build_parser, config_from_args, main
from trtssd.bench.config import ALL_SYSTEMS, BenchConfig, Instance, plan_instances
from trtssd.bench.prompts import PromptItem, encode_prompts, load_prompt_set, read_jsonl
from trtssd.bench.records import (
                                  BatchRecord,
                                  RequestRecord,
                                  RunKey,
                                  RunResult,
                                  per_token_latencies,
                                  percentile,
                                  summarize,
)
from trtssd.bench.report import (
                                  BenchReport,
                                  attach_comparisons,
                                  render_markdown,
                                  write_plots,
                                  write_report,
)
from trtssd.bench.runners import hf_source
from trtssd.bench.sweep import run_benchmark

__all__ = [
    "ALL_SYSTEMS", "BatchRecord", "BenchConfig", "BenchReport", "Instance", "PromptItem", "RequestRecord", "RunKey",
    "RunResult", "attach_comparisons", "build_parser", "compare_with_plan", "config_from_args", "encode_prompts",
    "hf_source", "load_prompt_set", "main", "measure_timings", "per_token_latencies", "percentile", "plan_instances",
    "read_jsonl", "render_markdown", "run_benchmark", "summarize", "workload_from_summary", "write_plots",
    "write_report",
]
