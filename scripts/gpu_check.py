"""GPU check: GPU pytest, ar/sd/ssd with both ranks on the GPU, kernel and executor timings.

Run through scripts/gpu_check.sh, which runs ``pytest -m gpu`` and then this script once per
section (``--section NAME``), each in its own process under its own time limit: a section that
fails, hangs or is killed loses only itself. Every run reads the one JSON file (--out), puts its
section in, and writes it back; a section is marked "started" before it runs, so one killed at
its limit is visible as such (``--section summary`` turns those marks into errors).

Sections
  env          versions, GPU name, SM count, whether MPI can launch the draft rank
  speculative  ar / sd / ssd on the default engine (engines/smollm2-135m, or --engine) with target
               and draft on the GPU: greedy outputs against ar, tokens/s, acceptance, cache hit
               rate, the transport used (CUDA IPC when the draft is its own process). Without
               mpi4py/mpiexec the draft runs in-process (launch="local"), and the JSON says so.
               Without the engine directory (it is 286 MB: too big to travel with the repo) a
               random-weight SmolLM2-135M-shaped pair is used instead, and the JSON says so.
  kernel       tree attention: Triton kernel (auto config and single launch) vs torch SDPA with a
               boolean mask (bf16) vs the full reference path, and vs the time to read the
               prefix K/V once at the H200's ~4.8 TB/s; the kernel's max error vs the reference
  sweep        a few launch configs on one verify and one tree shape (for tuning the heuristics)
  aot          the TensorRT-plugin kernel compiled to PTX with this machine's Triton
  executor     TorchExecutor decode / verify / tree steps on random-weight 1B- and 8B-shaped
               Llama models (bf16), with the Triton kernel and with the SDPA reference
  pytest       the ``pytest -m gpu`` log's summary (--pytest-rc, --pytest-log)
  summary      sections left "started" (killed at their limit) recorded as errors
Writes JSON to --out (gpu_check.sh: $OUT/gpu_check.json, else results/gpu_check.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger("gpu_check")

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak
TREE_BRANCHES = 32  # executor tree step: new tokens per sequence


@dataclass(frozen=True)
class LlamaShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool


DRAFT_1B = LlamaShape("draft-1B", 2048, 8192, 16, 32, 8, 64, 128256, True)  # Llama-3.2-1B
TARGET_8B = LlamaShape("target-8B", 4096, 14336, 32, 32, 8, 128, 128256, False)  # Llama-3.1-8B


class Budget:
    """Wall-clock budget of one section: items past it are skipped, and counted."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.skipped = 0

    def spent(self) -> bool:
        if time.monotonic() > self.deadline:
            self.skipped += 1
            return True
        return False


def bench_ms(fn) -> float:
    """Median milliseconds of fn on the GPU, L2 flushed between runs (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def section_env() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import tensorrt

        info["tensorrt"] = tensorrt.__version__
    except ImportError:
        info["tensorrt"] = None
    info["mpi_launch"] = mpi_launch_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name, sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1)
        )
    return info


def forest_masks(batch: int, n: int, depth: int, device) -> torch.Tensor:
    """n branches each at ``depth`` (chains of region slots); query f sees its own branch."""
    mask = torch.zeros(n, n * depth, dtype=torch.bool)
    for f in range(n):
        mask[f, f * depth : (f + 1) * depth] = True
    return mask.expand(batch, n, n * depth).to(device)


def attention_inputs(shape: LlamaShape, batch: int, prefix: int, n: int, device="cuda"):
    if n <= 8:  # verification: a chain of n new tokens
        mask = torch.ones(n, n, dtype=torch.bool).tril().expand(batch, n, n).to(device)
    else:  # a draft tree step: n branches, 4 deep
        mask = forest_masks(batch, n, 4, device)
    slots = prefix + mask.shape[2]
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, shape.heads, n, shape.head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(batch, shape.kv_heads, slots, shape.head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    prefix_len = torch.full((batch,), prefix, dtype=torch.long, device=device)
    return q, k, v, prefix_len, mask


def section_kernel(budget: Budget) -> list[dict]:
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in (DRAFT_1B, TARGET_8B):
        for batch in (1, 8):
            for prefix in (512, 2048, 8192):
                for n in (8, 32, 64):
                    if budget.spent():
                        continue
                    try:
                        rows.append(time_attention(shape, batch, prefix, n, sm_count))
                    except Exception as exc:  # record and go on with the next shape
                        rows.append(dict(model=shape.name, batch=batch, prefix=prefix, n=n, error=repr(exc)[:500]))
                        log.error("kernel %s B=%d P=%d n=%d failed: %r", shape.name, batch, prefix, n, exc)
    return rows


def time_attention(shape: LlamaShape, batch: int, prefix: int, n: int, sm_count: int) -> dict:
    import torch.nn.functional as F

    from trtssd.models.attention import tree_attention_reference, visibility_mask
    from trtssd.kernels.tree_attention_triton import KernelConfig, Problem, default_config, tree_attention_triton

    q, k, v, prefix_len, mask = attention_inputs(shape, batch, prefix, n)
    problem = Problem(batch, shape.heads, shape.kv_heads, n, shape.head_dim, k.shape[2], mask.shape[2])
    auto = default_config(problem, sm_count)
    single = KernelConfig(auto.block_m, auto.block_n, 1, auto.num_warps, auto.num_stages)
    full_mask = visibility_mask(prefix_len, mask, k.shape[2]).unsqueeze(1)
    out = tree_attention_triton(q, k, v, prefix_len, mask, config=auto)
    ref = tree_attention_reference(q, k, v, prefix_len, mask)
    kv_bytes = 2 * batch * shape.kv_heads * k.shape[2] * shape.head_dim * k.element_size()
    row = dict(
        model=shape.name, batch=batch, prefix=prefix, n=n, config=asdict(auto),
        max_err=(out.float() - ref.float()).abs().max().item(),
        ms_kernel=bench_ms(lambda: tree_attention_triton(q, k, v, prefix_len, mask, config=auto)),
        ms_kernel_single_launch=bench_ms(
            lambda: tree_attention_triton(q, k, v, prefix_len, mask, config=single)),
        ms_sdpa_bf16_mask=bench_ms(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=full_mask, enable_gqa=True)),
        ms_reference=bench_ms(lambda: tree_attention_reference(q, k, v, prefix_len, mask)),
        kv_bytes=kv_bytes,
        ms_bandwidth_bound=kv_bytes / HBM_BYTES_PER_S * 1e3,
    )  # fmt: skip
    row["bandwidth_fraction"] = row["ms_bandwidth_bound"] / row["ms_kernel"]
    log.info(
        "%-9s B=%d P=%5d n=%2d  kernel %.4f ms (1 launch %.4f, splits %d)  sdpa %.4f  ref %.4f  "
        "bound %.4f (%.0f%%)  err %.1e",
        shape.name, batch, prefix, n, row["ms_kernel"], row["ms_kernel_single_launch"],
        auto.num_splits, row["ms_sdpa_bf16_mask"], row["ms_reference"], row["ms_bandwidth_bound"],
        100 * row["bandwidth_fraction"], row["max_err"],
    )  # fmt: skip
    return row


def section_sweep(budget: Budget) -> list[dict]:
    from dataclasses import replace

    from trtssd.kernels.tree_attention_triton import Problem, default_config, tree_attention_triton

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape, batch, prefix, n in ((TARGET_8B, 1, 4096, 8), (DRAFT_1B, 4, 2048, 64)):
        q, k, v, prefix_len, mask = attention_inputs(shape, batch, prefix, n)
        problem = Problem(batch, shape.heads, shape.kv_heads, n, shape.head_dim, k.shape[2], mask.shape[2])
        auto = default_config(problem, sm_count)
        # One knob at a time around the heuristic's choice, then tile shapes at its split count.
        configs = [replace(auto, num_splits=s) for s in (1, 2, 4, 8, 16, 32)]
        configs += [replace(auto, block_n=bn, num_warps=w, num_stages=st)
                    for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]  # fmt: skip
        for config in dict.fromkeys(configs):  # dedupe, keep order
            if budget.spent():
                continue
            try:
                ms = bench_ms(lambda: tree_attention_triton(q, k, v, prefix_len, mask, config=config))
            except Exception as exc:  # e.g. out of shared memory for one config
                rows.append(dict(model=shape.name, batch=batch, prefix=prefix, n=n,
                                 config=asdict(config), error=repr(exc)[:300]))  # fmt: skip
                continue
            rows.append(dict(model=shape.name, batch=batch, prefix=prefix, n=n, config=asdict(config), ms=ms,
                             heuristic=config == auto))  # fmt: skip
    for key in {(r["model"], r["n"]) for r in rows}:
        timed = [r for r in rows if (r["model"], r["n"]) == key and "ms" in r]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            log.info("sweep best %s n=%d: %.4f ms with %s", key[0], key[1], best["ms"], best["config"])
    return rows


def section_aot() -> dict:
    import re

    from plugins.tree_attention.trt_plugin import SCALAR_ARGS, TENSOR_INPUTS, AotOptions, compile_aot_kernel

    major, minor = torch.cuda.get_device_capability(0)
    result = {}
    for dtype, head_dim in (("bfloat16", 128), ("float16", 64)):
        kernel = compile_aot_kernel(dtype, head_dim, head_dim**-0.5, AotOptions(arch=10 * major + minor))
        header = re.search(r"\.entry\s+\w+\s*\((.*?)\)", kernel.ptx, re.S).group(1)
        result[f"{dtype}-D{head_dim}"] = dict(
            params=header.count(".param"), expected=len(TENSOR_INPUTS) + len(SCALAR_ARGS) + 1,
            shared_mem=kernel.shared_mem, num_warps=kernel.num_warps,
        )  # fmt: skip
    log.info("aot: %s", result)
    return result


def random_llama(shape: LlamaShape, device: str):
    """A bf16 Llama-shaped model with random weights (std 0.02, norms 1)."""
    from trtssd.models.config import ModelConfig, RopeConfig
    from trtssd.models.llama import LlamaModel

    cfg = ModelConfig(
        arch="llama", vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0), tie_word_embeddings=shape.tied,
    )  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # allocate straight in bf16 on the GPU (8B: 16 GB)
    try:
        with torch.device(device):
            model = LlamaModel(cfg)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02)
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.zero_()
    return model.to(device=device, dtype=torch.bfloat16)


def step_chunks(kind: str, seq_ids, executor, chunk_mod):
    """One decode / verify / tree step's chunks, all sequences at their committed length."""
    chunks = []
    for sid in seq_ids:
        start = executor.committed(sid)
        if kind == "decode":
            chunks.append(chunk_mod.chain_chunk(sid, [1], start))
        elif kind == "verify":
            chunks.append(chunk_mod.chain_chunk(sid, list(range(1, 9)), start))
        else:  # tree: sibling branches one token deep, each sees itself only
            n = TREE_BRANCHES
            idx = torch.arange(n)
            mask = torch.eye(n, dtype=torch.bool)
            chunks.append(chunk_mod.Chunk(sid, idx + 1, torch.full((n,), start), start + idx, mask))
    return chunks


def time_step(executor, chunks, reps: int = 10) -> float:
    """Median wall milliseconds of one forward (the executor's host work included)."""
    sync = torch.cuda.synchronize if executor.device.type == "cuda" else (lambda: None)
    for _ in range(3):
        executor.forward(chunks)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        executor.forward(chunks)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def section_executor(
    budget: Budget,
    shapes=(DRAFT_1B, TARGET_8B),
    prefixes=(1024, 4096),
    batches=(1, 4),
    device: str = "cuda",
    prefill_chunk: int = 1024,
) -> list[dict]:
    import trtssd.backends.base as chunk_mod
    import trtssd.kernels as kernels
    from trtssd.backends.torch_backend import TorchExecutor

    rows = []
    real_loader = kernels.load_tree_attention_kernel
    for shape in shapes:
        if budget.spent():
            continue
        model = random_llama(shape, device)
        executor = TorchExecutor(
            model, max_seqs=max(batches), max_seq_len=max(prefixes) + 64,
            max_batch_tokens=max(prefill_chunk, TREE_BRANCHES * max(batches)),
            pack_linears=False, logits_device=device,  # kernel vs SDPA: no logits copy in the timing
        )  # fmt: skip
        for batch in batches:
            seq_ids = list(range(batch))
            for sid in seq_ids:
                executor.add_sequence(sid)
            for prefix in prefixes:
                if budget.spent():
                    continue
                for sid in seq_ids:  # prefill up to `prefix` in chunks
                    while executor.committed(sid) < prefix:
                        start = executor.committed(sid)
                        n = min(prefill_chunk, prefix - start)
                        executor.forward([chunk_mod.chain_chunk(sid, [7] * n, start, last_logits_only=True)])
                        executor.commit(sid, n)
                for kind in ("decode", "verify", "tree"):
                    if budget.spent():
                        continue
                    chunks = step_chunks(kind, seq_ids, executor, chunk_mod)
                    row = dict(model=shape.name, batch=batch, prefix=prefix, step=kind,
                               tokens=sum(c.tokens.numel() for c in chunks))  # fmt: skip
                    row["ms_triton"] = time_step(executor, chunks)
                    kernels.load_tree_attention_kernel = lambda: None  # dispatcher falls back to SDPA
                    try:
                        row["ms_sdpa_reference"] = time_step(executor, chunks)
                    finally:
                        kernels.load_tree_attention_kernel = real_loader
                    rows.append(row)
                    log.info("%-9s B=%d P=%5d %-6s triton %.2f ms  sdpa-ref %.2f ms", shape.name, batch, prefix,
                             kind, row["ms_triton"], row["ms_sdpa_reference"])  # fmt: skip
            for sid in seq_ids:
                executor.release(sid)
        del executor, model
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows



# --- ar / sd / ssd with both ranks on the GPU ---------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ENGINE_DIR = REPO / "engines" / "smollm2-135m"
SPEC_PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Write a Python function that checks whether a string is a palindrome.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Explain in two sentences what a hash table is.",
)
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                     tie_word_embeddings=True)


def mpi_launch_available() -> dict:
    """Whether the draft rank can be its own MPI process here (mpi4py and an mpiexec)."""
    try:
        from trtssd.runtime.draft_client import _mpiexec
        from trtssd.runtime.transport import require_mpi

        try:
            mpi = require_mpi("the spawn launch")
        except RuntimeError:
            return {"available": False, "why": "mpi4py (or its MPI library) cannot be imported"}
        return {"available": True, "mpiexec": _mpiexec(), "mpi": mpi.Get_library_version().splitlines()[0]}
    except Exception as exc:  # noqa: BLE001 - reported
        return {"available": False, "why": repr(exc)[:300]}


def random_smollm2_pair(root: Path) -> tuple[str, str]:
    """A SmolLM2-135M-shaped target (random weights) and a draft = target + small noise, as
    Hugging Face directories: the engine's shapes and costs, not its text or its hit rate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2_SHAPE)
    target = LlamaForCausalLM(cfg)
    target.save_pretrained(root / "target")
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.01 * torch.randn_like(p))
    target.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")


def _spec_models(engine: Path, tmp: Path) -> tuple[dict, dict, list]:
    """(LLM model keywords, what they are for the JSON, prompts)."""
    from trtssd.config import ModelRef
    from trtssd.models.engine_dir import is_engine_dir

    if is_engine_dir(engine):
        return {"engine": str(engine)}, {"engine": str(engine), "random_weights": False}, list(SPEC_PROMPTS)
    target, draft = random_smollm2_pair(tmp)
    why = f"{engine} is absent (the engine is 286 MB: too big to travel with the repo)"
    prompts = [[1 + (7 * i + j) % 1000 for j in range(24)] for i in range(len(SPEC_PROMPTS))]
    return ({"target": ModelRef(target), "draft": ModelRef(draft)},
            {"engine": None, "random_weights": True, "shape": "SmolLM2-135M", "why": why}, prompts)


def _aggregate(outs) -> dict:
    """Counts summed over requests, then the rates (the metrics' own definitions)."""
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "cache_hits", "cache_misses",
            "degraded_rounds", "plain_rounds", "num_generated_tokens")
    total = {k: sum(o.metrics[k] for o in outs) for k in keys}
    total["mean_acceptance_length"] = round(
        (total["num_accepted_tokens"] + total["num_drafts"]) / total["num_drafts"], 4) if total["num_drafts"] else 0.0
    lookups = total["cache_hits"] + total["cache_misses"]
    total["cache_hit_rate"] = round(total["cache_hits"] / lookups, 4) if lookups else 0.0
    return total


def run_mode(models: dict, prompts: list, mode: str, launch: str, max_tokens: int,
             device: str = "cuda") -> tuple[dict, list]:
    from trtssd.llm import LLM
    from trtssd.sampling import SamplingParams

    row = {"mode": mode, "launch": launch}
    t0 = time.perf_counter()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # plain_under_load off: the check is about the speculative path, which load control could skip
    with LLM(**models, mode=mode, launch=launch, target_device=device, draft_device=device, max_batch=1,
             max_model_len=512, plain_under_load=False) as llm:
        row["start_s"] = round(time.perf_counter() - t0, 2)
        row["transport"] = None if mode == "ar" else llm.runtime.resolved_transport.value
        if launch == "local" and mode != "ar":
            row["transport"] = "in-process host buffers (launch=local)"
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up: Triton compiles
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs, seconds = [], 0.0
        for prompt in prompts:  # batch 1, as the CPU benchmark
            sync()
            t = time.perf_counter()
            outs.append(llm.generate([prompt], params)[0])
            seconds += time.perf_counter() - t
        row["draft_alive_at_end"] = llm.draft_state == "alive" if mode != "ar" else None
    tokens = sum(len(o.token_ids) for o in outs)
    row.update(tokens=tokens, seconds=round(seconds, 3), tok_s=round(tokens / seconds, 2), **_aggregate(outs))
    log.info("%-3s launch=%s transport=%s: %.1f tok/s, acceptance %.2f, hit rate %.2f", mode, launch,
             row["transport"], row["tok_s"], row["mean_acceptance_length"], row["cache_hit_rate"])
    return row, [o.token_ids for o in outs]


def section_speculative(budget: Budget, engine: Path, max_tokens: int = 64, device: str = "cuda") -> dict:
    mpi = mpi_launch_available()
    launch = "spawn" if mpi["available"] else "local"
    result = {"device": device, "mpi": mpi, "launch": launch, "modes": {}}
    if launch == "local":
        result["note"] = "no MPI launch here: the draft ran in-process (launch='local'), no CUDA IPC, no overlap"
    with tempfile.TemporaryDirectory() as tmp:
        models, result["models"], prompts = _spec_models(engine, Path(tmp))
        ar_tokens = None
        for mode in ("ar", "sd", "ssd"):
            if budget.spent():
                result["modes"][mode] = {"skipped_for_time": True}
                continue
            tries = [launch] if mode == "ar" or launch == "local" else [launch, "local"]
            for attempt in tries:
                try:
                    row, tokens = run_mode(models, prompts, mode, attempt, max_tokens, device)
                except Exception:  # noqa: BLE001 - recorded; the in-process draft is tried next
                    result["modes"].setdefault(f"{mode}_errors", []).append(
                        {"launch": attempt, "error": traceback.format_exc()[-2500:]})
                    log.error("%s with launch=%s failed:\n%s", mode, attempt, traceback.format_exc()[-1500:])
                    continue
                if mode == "ar":
                    ar_tokens = tokens
                elif ar_tokens is not None:
                    row["greedy_equal_to_ar"] = tokens == ar_tokens
                    row["first_mismatch"] = _first_mismatch(tokens, ar_tokens)
                result["modes"][mode] = row
                break
    return result


def _first_mismatch(got: list[list[int]], want: list[list[int]]) -> dict | None:
    for i, (a, b) in enumerate(zip(got, want)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return {"prompt": i, "token": j, "got": x, "ar": y}
    return None


# --- one section per process -----------------------------------------------------------------


def read_pytest(log_path: Path | None, rc: int | None) -> dict:
    result = {"rc": rc}
    if log_path is not None and log_path.exists():
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
        result["summary"] = lines[-1] if lines else ""
        result["failures"] = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:50]
        result["skipped"] = [ln for ln in lines if ln.startswith("SKIPPED")][:50]
    return result


GPU_SECTIONS = ("speculative", "kernel", "sweep", "aot", "executor")


def run(args: argparse.Namespace) -> object:
    """The section's result (raises on failure)."""
    name = args.section
    if name == "env":
        return section_env()
    if name == "pytest":
        return read_pytest(args.pytest_log, args.pytest_rc)
    if name in GPU_SECTIONS and not torch.cuda.is_available() and args.device != "cpu":
        raise RuntimeError("no CUDA device")
    budget = Budget(args.budget_s)
    result = {
        "speculative": lambda: section_speculative(budget, args.engine, args.max_tokens, args.device),
        "kernel": lambda: section_kernel(budget),
        "sweep": lambda: section_sweep(budget),
        "aot": section_aot,
        "executor": lambda: section_executor(budget),
    }[name]()
    if budget.skipped:
        return {"result": result, "skipped_for_time": budget.skipped}
    return result


def load_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        report = {}
    report.setdefault("errors", {})
    report.setdefault("seconds", {})
    report.setdefault("status", {})
    return report


def save_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)  # a reader never sees half a file


def summarize(report: dict, limits: dict[str, float], expected: tuple[str, ...] = ()) -> None:
    for name in expected:
        if name not in report["status"]:  # killed before it could even mark itself started
            report["status"][name] = "missing"
            report["errors"][name] = "no result: killed at its time limit before it started, or never run"
    for name, status in report["status"].items():
        if status == "started":
            report["status"][name] = "killed"
            report["errors"][name] = f"killed at its time limit ({limits.get(name, '?')} s) before it finished"
    log.info("pytest -m gpu: %s", report.get("pytest", {}).get("summary"))
    log.info("sections: %s; errors in: %s", report["status"], sorted(report["errors"]) or "none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", required=True, choices=("env", "pytest", *GPU_SECTIONS, "summary"))
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=60.0, help="this section's time for its timed items")
    parser.add_argument("--limit-s", type=float, default=None, help="the hard limit gpu_check.sh kills it at")
    parser.add_argument("--pytest-rc", type=int, default=None)
    parser.add_argument("--pytest-log", type=Path, default=None)
    parser.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR, help="engine for the speculative section")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt in the speculative section")
    parser.add_argument("--expect", default="", help="summary: comma-separated sections that should have run")
    parser.add_argument("--device", default="cuda", help="speculative section: 'cpu' to try the check itself here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    report = load_report(args.out)
    if args.section == "summary":
        summarize(report, report.get("limits", {}), tuple(n for n in args.expect.split(",") if n))
        save_report(args.out, report)
        return
    report["status"][args.section] = "started"
    report.setdefault("limits", {})[args.section] = args.limit_s
    save_report(args.out, report)
    t0 = time.monotonic()
    error = None
    try:
        value, status = run(args), "ok"
    except Exception:  # noqa: BLE001 - recorded; the other sections run anyway
        value, status, error = None, "failed", traceback.format_exc()[-3000:]
        log.error("section %s failed:\n%s", args.section, error)
    if value is not None:
        report[args.section] = value
    if error is not None:
        report["errors"][args.section] = error
    report["status"][args.section] = status
    report["seconds"][args.section] = round(time.monotonic() - t0, 1)
    save_report(args.out, report)
    if status != "ok":
        sys.exit(1)


if __name__ == "__main__":
    main()
