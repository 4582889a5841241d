"""Runners, one per loaded system: trtssd's LLM, transformers (greedy and assisted), llama.cpp's llama-server."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from trtssd.bench.config import BenchConfig
from trtssd.bench.records import BatchRecord, RequestRecord, RunKey, per_token_latencies
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.structured.constraint import Constraint

log = logging.getLogger(__name__)


class TrtssdRunner:
    """One LLM (one mode, K and fan-out budget); closed before the next is started."""

    def __init__(self, cfg: BenchConfig, system: str, k: int | None, budget: int | None, max_seq_len: int):
        from trtssd.config import ModelRef
        from trtssd.llm import LLM

        mode = "ssd" if system == "auto" else system
        options = dict(cfg.llm_options, mode=mode, max_batch=max(cfg.batch_sizes), max_model_len=max_seq_len,
                       target_device=cfg.target_device, draft_device=cfg.draft_device,
                       lend_draft_cores=cfg.lend_draft_cores)
        if mode != "ar":
            options.update(plain_under_load=system == "auto")
        if cfg.shared_cores:  # e.g. "sd given both cores": each rank runs on all of them in turn
            cores = tuple(sorted(os.sched_getaffinity(0)))
            options.update(target_threads=len(cores), draft_threads=len(cores), target_cores=cores, draft_cores=cores)
        if mode != "ar":
            options.update(k=k, backup=cfg.backup)
        if mode == "ssd":
            options.update(fanout_budget=budget)
            if cfg.saguaro_c is not None:
                options.update(saguaro_c=cfg.saguaro_c)
        self.llm = LLM(cfg.engine, target=ModelRef(cfg.target) if cfg.target else None,
                       draft=ModelRef(cfg.draft) if cfg.draft else None, **options)

    def run_batch(self, key: RunKey, prompts: Sequence[list[int]], ids: Sequence[str], cfg: BenchConfig,
                  seed: int, constraints: Sequence[Constraint | None] = ()) -> tuple[BatchRecord, SpeculationMetrics]:
        from trtssd.sampling import SamplingParams

        # Drives the engine step by step (rather than LLM.generate) to time every emission.
        engine = self.llm.loop
        constraints = list(constraints) or [None] * len(prompts)
        # A constrained answer ends where its grammar does: ignore_eos is for free text only.
        params = [SamplingParams(temperature=key.temperature, max_tokens=cfg.max_tokens,
                                 ignore_eos=cfg.ignore_eos and c is None, constraint=c,
                                 seed=seed + i if key.temperature > 0 else None) for i, c in enumerate(constraints)]
        start = time.perf_counter()
        seqs = [engine.new_sequence(list(p), sp) for p, sp in zip(prompts, params)]
        for seq in seqs:
            engine.add(seq)
        seq_ids = [seq.seq_id for seq in seqs]
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
        metrics = SpeculationMetrics()
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
    file, or for an engine directory the model its ``side`` runs (for an int4 draft, the model it
    was quantized from)."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return str(p.parent), {"gguf_file": p.name}
    if (p / "config.json").is_file():
        return str(p), {}
    manifest = p / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        entry = data.get(side, {}) if isinstance(data.get(side), dict) else {}
        if entry.get("backend") == "torch-int4":
            return _int4_source(data, side, manifest)
        for field_name in ("source", "gguf", "hf_dir", "path", "weights"):
            value = entry.get(field_name) or data.get(f"{side}_{field_name}")
            if isinstance(value, str):
                candidate = (p / value) if not Path(value).is_absolute() else Path(value)
                if candidate.exists() and candidate != p:
                    return hf_source(str(candidate), side)
        raise ValueError(f"engine manifest {manifest} names no transformers-loadable {side} model "
                         f"(looked for source/gguf/hf_dir/path/weights in {sorted(entry) or sorted(data)})")
    raise ValueError(f"{path} is neither a .gguf file, a transformers directory nor an engine directory")


def _built_from(data: dict, side: str) -> str | None:
    """The model an engine's ``side`` was built from, as trtssd.build recorded it."""
    recipe = data.get("build", {}).get("recipe", {})
    value = recipe.get(side)
    return value if isinstance(value, str) else None


def _int4_source(data: dict, side: str, manifest: Path) -> tuple[str, dict]:
    source = _built_from(data, side)
    if source is None or not Path(source).exists():
        raise ValueError(f"the int4 {side} of {manifest.parent} was built from {source or 'an unrecorded model'}, "
                         f"which is not on this machine (give --hf-{side})")
    return hf_source(source, side)


def _is_self_draft(path: str) -> bool:
    """An engine whose draft is the target's own weights, quantized (trtssd.build's int4 self-draft)."""
    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        return False
    data = json.loads(manifest.read_text())
    draft = data.get("draft", {})
    if not (isinstance(draft, dict) and draft.get("backend") == "torch-int4"):
        return False
    source = _built_from(data, "draft")
    return source is None or source == _built_from(data, "target")


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
                  seed: int, constraints: Sequence[Constraint | None] = ()) -> tuple[BatchRecord, None]:
        import torch

        if any(c is not None for c in constraints):
            raise SkipRun("the transformers peers decode without constraints; constrained prompt sets are not run there")
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
    """llama.cpp's llama-server on the engine's GGUF files: ``llama.cpp`` decodes plainly,
    ``llama.cpp-sd`` drafts with the draft GGUF (K = ``--spec-draft-n-max``).

    One server per instance, with a slot per row of the largest batch; a batch of N is N
    concurrent /completion requests. Prompts go as token ids (no BOS added: the same ids trtssd
    sees), ``cache_prompt`` off so every request pays its prefill as trtssd's do. TTFT is the
    server's own prompt time (the requests do not stream); a request's end is when its reply
    arrives; tokens per delivery estimate llama.cpp's acceptance length (tokens / (tokens - accepted)).
    """

    def __init__(self, cfg: BenchConfig, system: str, k: int | None, max_seq_len: int):
        from trtssd.bench.llamacpp import LlamaServer, LlamaServerError, ServerOptions, ensure_llama_server

        try:
            binary = ensure_llama_server()
        except LlamaServerError as e:
            raise SkipRun(str(e)) from e
        target, draft, where = gguf_files(cfg)
        if system == "llama.cpp-sd" and draft is None:
            raise SkipRun(where)
        speculative = system == "llama.cpp-sd"
        draft_max = k or 3
        options = ServerOptions(model=target, draft=draft if speculative else None, draft_max=draft_max,
                                threads=cfg.llamacpp_threads, parallel=max(cfg.batch_sizes),
                                ctx_per_slot=max_seq_len + (draft_max if speculative else 0) + 16, seed=cfg.seed)
        self.server = LlamaServer(options, binary)
        self.server.start()
        self.peer_note = (f"{where}; llama-server {binary} with {cfg.llamacpp_threads} thread(s) per model, "
                          "--no-repack, prompts as token ids, no prompt cache")

    def run_batch(self, key: RunKey, prompts: Sequence[list[int]], ids: Sequence[str], cfg: BenchConfig,
                  seed: int, constraints: Sequence[Constraint | None] = ()) -> tuple[BatchRecord, None]:
        from concurrent.futures import ThreadPoolExecutor

        constraints = list(constraints) or [None] * len(prompts)
        schemas = [llamacpp_schema(c) for c in constraints]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futures = [pool.submit(self._request, key, p, cfg, seed + i, schema)
                       for i, (p, schema) in enumerate(zip(prompts, schemas))]
            replies = [f.result() for f in futures]
        wall = time.perf_counter() - start
        records = tuple(_llamacpp_record(pid, prompt, reply, end - start)
                        for pid, prompt, (reply, end) in zip(ids, prompts, replies))
        return BatchRecord(records, wall, max(r.ttft_s for r in records)), None

    def _request(self, key: RunKey, prompt: Sequence[int], cfg: BenchConfig, seed: int,
                 schema: dict | None = None) -> tuple[dict, float]:
        from trtssd.bench.llamacpp import sampling_body

        body = {"prompt": [int(t) for t in prompt], "n_predict": cfg.max_tokens,
                "ignore_eos": cfg.ignore_eos and schema is None,
                "cache_prompt": False, "return_tokens": True, "stream": False,
                **sampling_body(key.temperature, seed)}
        if schema is not None:  # llama-server turns it into its own grammar, as for response_format
            body["json_schema"] = schema
        reply = self.server.completion(body)
        return reply, time.perf_counter()

    def close(self) -> None:
        server, self.server = getattr(self, "server", None), None
        if server is not None:
            server.stop()


def llamacpp_schema(constraint: Constraint | None) -> dict | None:
    """The JSON schema llama-server's /completion takes (``json_schema``) for a constraint; a regex,
    choice or grammar (tool calls included) has no llama-server form here, so that cell is skipped."""
    if constraint is None:
        return None
    if constraint.kind == "json_object":
        return {"type": "object"}
    if constraint.kind == "json_schema":
        return constraint.schema
    raise SkipRun(f"llama-server is sent JSON schemas only; a {constraint.kind} constraint (regex, choice, grammar, "
                  "forced tool call) is not translated to its GBNF, so constrained sets holding one are not run there")


def _llamacpp_record(prompt_id: str, prompt: Sequence[int], reply: dict, e2e_s: float) -> RequestRecord:
    """A RequestRecord from a /completion reply (its ``timings``) and the client's time to it."""
    tokens = tuple(int(t) for t in reply.get("tokens") or ())
    if not tokens:
        raise RuntimeError(f"request {prompt_id!r}: llama-server returned no tokens ({reply.get('stop_type')!r})")
    timings = reply.get("timings", {})
    ttft = timings.get("prompt_ms", 0.0) / 1e3
    decode = timings.get("predicted_ms", 0.0) / 1e3
    accepted = int(timings.get("draft_n_accepted") or 0)
    rest = len(tokens) - 1
    finish = {"limit": "length", "eos": "stop", "word": "stop"}.get(reply.get("stop_type"), "unknown")
    return RequestRecord(prompt_id, len(prompt), tokens, finish, ttft, max(e2e_s, ttft),
                         tuple([decode / rest] * rest) if rest else (), max(len(tokens) - accepted, 1), 1)


def gguf_files(cfg: BenchConfig) -> tuple[Path, Path | None, str]:
    """(target GGUF, draft GGUF or None, a note on where they came from) for llama.cpp.

    With --target/--draft the files given; for an engine directory its manifest: a side stored
    as a GGUF ("path" ending in .gguf) is that file; an int4 self-draft (quantized from the
    target) becomes the target's own GGUF, the closest llama.cpp has to it; otherwise the GGUF
    the build recorded as the side's source ("build.recipe"), if it is still on this machine.
    """
    if cfg.target is not None:
        target = Path(cfg.target)
        if target.suffix != ".gguf":
            raise SkipRun(f"llama.cpp needs a GGUF target; got {target}")
        draft = Path(cfg.draft) if cfg.draft else target
        if draft.suffix != ".gguf":
            return target, None, f"the draft {draft} is not a GGUF file"
        return target, draft, f"llama.cpp: target {target.name}, draft {draft.name}"
    engine = Path(cfg.model_refs()[0].path)
    manifest = json.loads((engine / "manifest.json").read_text())
    target = _side_gguf(engine, manifest, "target")
    if target is None:
        raise SkipRun(f"engine {engine.name} has no GGUF target (llama.cpp runs GGUF files only)")
    if _is_self_draft(str(engine)):
        return target, target, f"llama.cpp-sd: draft = the target's own GGUF (engine {engine.name} self-drafts)"
    draft = _side_gguf(engine, manifest, "draft")
    if draft is None:
        return target, None, f"engine {engine.name}'s draft is not a GGUF file on this machine"
    return target, draft, f"llama.cpp: target {target}, draft {draft}"


def _side_gguf(engine: Path, manifest: dict, side: str) -> Path | None:
    entry = manifest.get(side)
    stored = entry.get("path") if isinstance(entry, dict) else None
    if isinstance(stored, str) and stored.endswith(".gguf") and (engine / stored).is_file():
        return (engine / stored).resolve()  # engines link their GGUF in; llama.cpp mmaps it either way
    source = _built_from(manifest, side)
    if source is not None and source.endswith(".gguf") and Path(source).is_file():
        return Path(source)
    return None


class SkipRun(Exception):
    """This system cannot run this cell; the reason is recorded in the results."""
