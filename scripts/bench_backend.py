#!/usr/bin/env python
"""Benchmark the torch backend (TorchExecutor) next to transformers' own forward, same shapes.

With one thread and a committed context (default 200 tokens) it times: a one-token decode step,
K+1-token verification for K = 2..8, one tree step of 8/16/24/32 branches (each branch one new
token over a K+1 glue region), and the prefill of the context itself. transformers runs the same
token counts through its KV cache (plain causal attention for the tree rows: it has no tree
mask, the compute shape is the same). The two are timed alternately, call after call, so load
from other processes hits both alike; we report the median and the minimum.

    .venv/bin/python scripts/bench_backend.py                      # SmolLM2, fp32 and bf16
    .venv/bin/python scripts/bench_backend.py --dtypes int4        # the GGUF's own 4-bit codes

``int4`` runs the model's Q4_1 codes through torch's int4 kernel (bf16 activations; the default
engine's draft, `trtssd/models/quant.py`) next to transformers in fp32, which has no int4 CPU path:
it answers "how fast is a decode step of this checkpoint", not "same numerics".
    .venv/bin/python scripts/bench_backend.py --dtypes float32 --reps 5 --out /tmp/b.json

Writes JSON (``--out``) and a markdown table next to it (same name, .md).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from trtssd.backends.base import Chunk, chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.models.loader import is_gguf, load_model

log = logging.getLogger("bench_backend")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int4": torch.float32}
GLUE = 5  # tree steps hang off a K+1 = 5 token glue region


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # decode | verify | tree | prefill
    tokens: int


@dataclass(frozen=True)
class Row:
    dtype: str
    shape: str
    tokens: int
    ours_ms: float  # median
    ours_min_ms: float
    hf_ms: float  # median, transformers at the same dtype
    hf_min_ms: float
    speedup: float  # hf_ms / ours_ms (medians)


def shapes() -> list[Shape]:
    out = [Shape("decode", "decode", 1)]
    out += [Shape(f"verify K={k}", "verify", k + 1) for k in range(2, 9)]
    out += [Shape(f"tree {b} branches", "tree", b) for b in (8, 16, 24, 32)]
    return out


def tree_chunk(seq_id: int, committed: int, branches: int) -> Chunk:
    """Step 0 of a tree: branch i forks at glue depth i % GLUE and sees glue[0..depth] + itself."""
    region = GLUE + branches
    mask = torch.zeros(branches, region, dtype=torch.bool)
    depth = torch.arange(branches) % GLUE
    for i in range(branches):
        mask[i, : depth[i] + 1] = True
        mask[i, GLUE + i] = True
    slots = committed + GLUE + torch.arange(branches)
    tokens = torch.arange(branches) + 7
    return Chunk(seq_id, tokens, committed + depth + 1, slots, mask)


def our_step(ex: TorchExecutor, shape: Shape, context: int) -> Callable[[], object]:
    if shape.kind == "tree":
        chunk = tree_chunk(0, context, shape.tokens)
    else:
        chunk = chain_chunk(0, list(range(11, 11 + shape.tokens)), context)
    return lambda: ex.forward([chunk])


def cache_kwarg(model) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_step(model, cache, shape: Shape, context: int) -> Callable[[], object]:
    ids = torch.arange(11, 11 + shape.tokens)[None]
    positions = torch.arange(context, context + shape.tokens)[None]
    kwargs = {cache_kwarg(model): cache}

    def step():
        with torch.no_grad():
            out = model(ids, position_ids=positions, use_cache=True, **kwargs)
        cache.crop(-shape.tokens)  # back to the context: every call sees the same shape
        return out

    return step


def time_alternately(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 2) -> dict[str, list[float]]:
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def _our_model(path: Path, dtype_name: str):
    if dtype_name != "int4":
        return load_model(path, DTYPES[dtype_name])
    from trtssd.build import build_engine, default_engine
    from trtssd.models.engine_dir import load_draft_model
    from trtssd.models.smollm2 import ensure_smollm2_gguf

    if is_gguf(path):  # int4 groups come from the engine build (Q4_1 codes kept exactly)
        return load_draft_model(default_engine() if path == ensure_smollm2_gguf() else build_engine(str(path)))
    raise SystemExit("--dtypes int4 needs a Q4_1 GGUF model (the default SmolLM2 is one)")


def bench_dtype(path: Path, dtype_name: str, context: int, reps: int, prefill_reps: int) -> list[Row]:
    from transformers import AutoModelForCausalLM, DynamicCache

    dtype = DTYPES[dtype_name]  # transformers' dtype (fp32 next to int4)
    ex = TorchExecutor(_our_model(path, dtype_name), max_seqs=1, max_seq_len=context + 64, max_batch_tokens=context + 64)
    log.info("ours (%s): %s", dtype_name, ex.memory)
    kwargs = {"gguf_file": path.name} if is_gguf(path) else {}
    hf = AutoModelForCausalLM.from_pretrained(path.parent if is_gguf(path) else path, dtype=dtype, **kwargs).eval()
    prompt = torch.randint(100, ex.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()

    ex.add_sequence(0)
    prefill_chunk = chain_chunk(0, prompt, 0, last_logits_only=True)
    ex.forward([prefill_chunk])
    ex.commit(0, context)
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(torch.tensor([prompt]), use_cache=True, **{cache_kwarg(hf): cache})

    def hf_prefill():
        with torch.no_grad():
            return hf(torch.tensor([prompt]), logits_to_keep=1)

    rows = []
    for shape in shapes():
        t = time_alternately({"ours": our_step(ex, shape, context), "hf": hf_step(hf, cache, shape, context)}, reps)
        rows.append(_row(dtype_name, shape.name, shape.tokens, t))
        _log_row(rows[-1])
    # Prefill of the whole context: a second sequence row, released after each call.
    ex2 = TorchExecutor(ex.model, max_seqs=1, max_seq_len=context + 1, pack_linears=False)

    def ours_full_prefill():
        ex2.add_sequence(1)
        try:
            return ex2.forward([chain_chunk(1, prompt, 0, last_logits_only=True)])
        finally:
            ex2.release(1)

    t = time_alternately({"ours": ours_full_prefill, "hf": hf_prefill}, prefill_reps, warmup=1)
    rows.append(_row(dtype_name, f"prefill {context}", context, t))
    _log_row(rows[-1])
    return rows


def _log_row(r: Row) -> None:
    log.info("%s %-18s ours %7.2f ms  transformers %7.2f ms", r.dtype, r.shape, r.ours_ms, r.hf_ms)


def _row(dtype: str, name: str, tokens: int, t: dict[str, list[float]]) -> Row:
    ours, hf = statistics.median(t["ours"]), statistics.median(t["hf"])
    return Row(dtype, name, tokens, round(ours, 2), round(min(t["ours"]), 2), round(hf, 2), round(min(t["hf"]), 2),
               round(hf / ours, 2))


def markdown(rows: list[Row], meta: dict) -> str:
    lines = [
        f"Context {meta['context']} tokens, {meta['threads']} thread, {meta['reps']} alternating reps per shape "
        f"(median; min in parentheses), torch {meta['torch']}, transformers {meta['transformers']}.",
        "",
        "| dtype | step | tokens | ours ms | transformers ms | speedup |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.dtype} | {r.shape} | {r.tokens} | {r.ours_ms:.2f} ({r.ours_min_ms:.2f}) | "
                     f"{r.hf_ms:.2f} ({r.hf_min_ms:.2f}) | {r.speedup:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--context", type=int, default=200, help="committed tokens before each step")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per shape and implementation")
    parser.add_argument("--prefill-reps", type=int, default=4, help="timed prefills per implementation")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("results/bench_backend.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        parser.error(f"--dtypes: unknown {bad}; allowed {list(DTYPES)}")
    if args.context < 1 or args.reps < 1:
        parser.error("--context and --reps must be >= 1")
    torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from trtssd.models.smollm2 import ensure_smollm2_gguf

        path = ensure_smollm2_gguf()

    import transformers

    rows = [r for d in dtypes for r in bench_dtype(path, d, args.context, args.reps, args.prefill_reps)]
    meta = dict(model=str(path), context=args.context, threads=args.threads, reps=args.reps,
                torch=torch.__version__, transformers=transformers.__version__,
                cpu=platform.processor() or platform.machine(),
                note="shared 2-core machine: other processes add noise; medians of alternating calls")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    args.out.with_suffix(".md").write_text(markdown(rows, meta))
    log.info("wrote %s and %s", args.out, args.out.with_suffix(".md"))
    log.info("\n%s", markdown(rows, meta))


if __name__ == "__main__":
    main()
