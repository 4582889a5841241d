"""Command line: trtssd generate | build | bench | plan."""

from __future__ import annotations

import argparse
import json
import logging
import sys

log = logging.getLogger("trtssd")


def _generate(args: argparse.Namespace) -> int:
    from trtssd.llm import LLM
    from trtssd.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.seed, stop=tuple(args.stop or ()),
    )
    options = dict(mode=args.mode, k=args.k, launch=args.launch, max_seq_len=args.max_seq_len)
    if args.fanout != "auto":
        options["fanout"] = tuple(int(x) for x in args.fanout.split(","))
    if args.backup:
        options["backup"] = args.backup
    with LLM(args.engine, **options) as llm:
        prompts = args.prompt or ["Write a Python function that returns the n-th Fibonacci number."]
        outs = llm.generate(prompts, params)
        aggregate = llm.metrics.summary()
    if args.json:
        payload = [
            {"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
             "metrics": o.metrics}
            for o in outs
        ]
        json.dump({"outputs": payload, "aggregate": aggregate}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for o in outs:
            m = o.metrics
            tok_s = len(o.token_ids) / m["e2e_s"] if m["e2e_s"] else 0.0
            sys.stdout.write(f"{o.text}\n\n")
            log.warning(
                "mode=%s tokens=%d %.1f tok/s acceptance_len=%.2f hit_rate=%.2f overlap=%.2f finish=%s",
                args.mode, len(o.token_ids), tok_s, m["mean_acceptance_length"], m["cache_hit_rate"],
                m["overlap_efficiency"], o.finish_reason,
            )
    return 0


def _build(args: argparse.Namespace) -> int:
    from trtssd.build import build_engine

    path = build_engine(args.name, args.out)
    sys.stdout.write(f"{path}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench and plan own their argument parsers
    if argv and argv[0] in ("bench", "plan"):
        import importlib

        return importlib.import_module(f"trtssd.{argv[0]}").main(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="trtssd", description="speculative speculative decoding runtime")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with ar, sd or ssd")
    g.add_argument("--engine", default=None, help="engine directory (default: the embedded SmolLM2 engine)")
    g.add_argument("--mode", choices=["ar", "sd", "ssd"], default="ssd")
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--k", type=int, default=5, help="lookahead")
    g.add_argument("--fanout", default="auto", help="'auto' or K+1 comma-separated ints")
    g.add_argument("--backup", choices=["auto", "neural", "fast"], default=None)
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--launch", choices=["spawn", "world"], default="spawn",
                   help="spawn: the draft is started as its own MPI job; world: under mpiexec -n 2")
    g.add_argument("--json", action="store_true", help="print text, token ids and metrics as JSON")
    g.set_defaults(func=_generate)

    b = sub.add_parser("build", help="build an engine directory (target + draft + manifest)")
    b.add_argument("name", nargs="?", default="smollm2-135m")
    b.add_argument("--out", default=None, help="engines directory (default: ./engines)")
    b.set_defaults(func=_build)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "generate" and args.launch == "world":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if world.Get_size() > 1 and world.Get_rank() == world.Get_size() - 1:
            from trtssd.runtime.draft_rank import serve

            serve(world, target_rank=0)
            return 0
    try:
        return args.func(args)
    except (ValueError, TypeError) as err:
        parser.error(str(err))
        return 2


if __name__ == "__main__":
    sys.exit(main())
