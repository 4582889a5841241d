"""The `trtssd bench` command line."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

import trtssd.bench.serve as serve
from trtssd.bench.config import ALL_SYSTEMS, BenchConfig
from trtssd.bench.prompts import BUILTIN_SETS, KNOWN_SETS, load_prompt_set
from trtssd.bench.report import render_markdown, write_report
from trtssd.bench.sweep import run_benchmark
from trtssd.cli_options import add_engine_options, add_model_options, engine_options

log = logging.getLogger(__name__)


PRESETS = {
    # The default: a few minutes per system on a 2-core CPU.
    "quick": dict(prompts_per_set=4, max_tokens=64, batch_sizes=(1,), temperatures=(0.0,)),
    # The full matrix: batch sizes 1..8, greedy and sampled (hours on a 2-core CPU).
    "full": dict(prompts_per_set=16, max_tokens=128, batch_sizes=(1, 2, 4, 8), temperatures=(0.0, 0.8)),
}

# Engine options each run sets itself: the system gives the mode (and plain_under_load: "auto"
# against "ssd"), --k and --budget sweep K and the fan-out budget (a fixed fan-out would tie K),
# --batch gives max_batch and the longest prompt gives max_model_len.
SWEPT = ("mode", "k", "fanout", "fanout_budget", "plain_under_load", "max_batch", "max_model_len")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints; got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers; got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtssd bench", description=__doc__.split("\n\n")[0],
                                epilog="trtssd bench serve --help: load-test a running OpenAI-compatible server; "
                                       "trtssd bench prefill --help: multi-turn TTFT and long-prompt arrivals")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="4 prompts per set x 64 tokens, batch 1, greedy (default)")
    size.add_argument("--full", action="store_true", help="16 prompts x 128 tokens, batch 1,2,4,8, temperature 0,0.8")
    add_model_options(p)
    p.add_argument("--systems", type=_names, default=ALL_SYSTEMS, help=f"subset of {','.join(ALL_SYSTEMS)}")
    p.add_argument("--datasets", type=_names, default=BUILTIN_SETS,
                   help=f"built-in sets ({','.join(KNOWN_SETS)}; default {','.join(BUILTIN_SETS)}) and/or JSONL "
                        "files (or .json lists); an entry with response_format, structured_outputs, tools/tool_choice "
                        "or schema runs under that constraint (json-schemas: 8 schemas, 2 forced tool calls)")
    p.add_argument("--prompts", type=int, help="prompts per set (--quick 4, --full 16)")
    p.add_argument("--max-tokens", type=int, help="output tokens per prompt (--quick 64, --full 128)")
    p.add_argument("--batch", type=_ints, help="batch sizes, e.g. 1,2,4,8")
    p.add_argument("--temperature", type=_floats, help="temperatures, e.g. 0,0.8")
    p.add_argument("--k", type=_ints, default=(), help="lookaheads (sweep: 3,5,7; default: the engine's)")
    p.add_argument("--budget", type=_ints, default=(), help="ssd fan-out budgets (sweep: 6,12,24; default: the engine's)")
    p.add_argument("--allow-eos", action="store_true", help="stop at EOS (default: exactly --max-tokens tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-threads", type=int, default=1, help="torch threads for the transformers peers")
    p.add_argument("--llamacpp-threads", type=int, default=1,
                   help="llama-server threads per model (target, and the draft in llama.cpp-sd); default 1, "
                   "as trtssd's one core per rank")
    p.add_argument("--llamacpp-draft-max", type=_ints, default=(),
                   help="llama.cpp-sd draft lengths (--spec-draft-n-max), a row each, e.g. 2,3,4,6 "
                   "(default: the --k values)")
    p.add_argument("--hf-target", default=None, help="transformers source of the target (dir or .gguf)")
    p.add_argument("--hf-draft", default=None, help="transformers source of the assistant model")
    p.add_argument("--no-calibrate", action="store_true", help="skip forward timing and the plan comparison")
    p.add_argument("--handshake-s", type=float, default=None, help="plan: fixed handshake seconds")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--shared-cores", action="store_true",
                   help="trtssd ranks each use every core (threads = cores) instead of one core each")
    p.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    p.add_argument("--log-level", default="WARNING")
    add_engine_options(p, skip=SWEPT)  # for every trtssd system
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    preset = dict(PRESETS["full" if args.full else "quick"])
    for arg, name in (("prompts", "prompts_per_set"), ("max_tokens", "max_tokens"), ("batch", "batch_sizes"),
                      ("temperature", "temperatures")):
        if getattr(args, arg) is not None:
            preset[name] = getattr(args, arg)
    llm_options = engine_options(args)
    # Those BenchConfig has fields for (the report shows them) go there; it passes the rest on.
    named = {name: llm_options.pop(name) for name in list(llm_options) if name in BenchConfig.__dataclass_fields__}
    return BenchConfig(
        engine=args.engine, target=args.target, draft=args.draft, systems=args.systems, datasets=args.datasets,
        ks=args.k, budgets=args.budget, ignore_eos=not args.allow_eos, seed=args.seed, warmup=not args.no_warmup,
        peer_threads=args.peer_threads, llamacpp_threads=args.llamacpp_threads,
        llamacpp_draft_max=args.llamacpp_draft_max, shared_cores=args.shared_cores, hf_target=args.hf_target,
        hf_draft=args.hf_draft, calibrate=not args.no_calibrate, handshake_s=args.handshake_s, out_dir=Path(args.out),
        plots=not args.no_plots, llm_options=llm_options, **named, **preset)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":  # `trtssd bench serve`: load-tests a running server, its own parser
        return serve.main(argv[1:])
    if argv and argv[0] == "prefill":  # `trtssd bench prefill`: prompt work under serving, its own parser
        import trtssd.bench.prefill_load as prefill_load

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return prefill_load.main(argv[1:], shlex.join(["trtssd", "bench", *argv]))
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
        for ds in cfg.datasets:  # fail fast on a bad dataset or entry, before loading any model
            load_prompt_set(ds, cfg.prompts_per_set)
    except ValueError as err:
        parser.error(str(err))
        return 2
    # The process's own command line (python -m ..., trtssd bench ...).
    # Results are written after each system (without plots), then once more in full at the end.
    report = run_benchmark(cfg, shlex.join(sys.argv), lambda so_far: write_report(so_far, cfg.out_dir, plots=False))
    for path in write_report(report, cfg.out_dir, cfg.plots):
        log.warning("wrote %s", path)
    sys.stdout.write(render_markdown(report))
    return 0 if any(r.error is None for r in report.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
