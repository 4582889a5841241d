"""`LLM`: the Python API. Starts the target here and the draft rank as its own MPI process.

    from trtssd import LLM, SamplingParams
    with LLM(mode="ssd") as llm:
        out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, Sequence

from trtssd.config import (Mode, ModelRef, RuntimeConfig, SpeculativeConfig, VerifierKind, renamed_options,
                           speculative_config)
from trtssd.cores import cores_besides, pin, pin_thread, restore, split_cores
from trtssd.devices import resolve_device
from trtssd.engines import resolve_models
from trtssd.models.engine_dir import MANIFEST, engine_speculation
from trtssd.models.tokenizer import chat_prompt_ids, encode_text, load_tokenizer
from trtssd.runtime.core_lending import core_lending
from trtssd.runtime.launch import LAUNCHES, close_target, start_draft, start_target
from trtssd.runtime.world import end_world_job
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.text.output_processor import OutputText, Prompt, RequestOutput, request_output
from trtssd.runtime.round_policy import calibrate_target
from trtssd.runtime.target_loop import TargetLoop
from trtssd.runtime.verifiers import Verifier
from trtssd.sampling import FieldError, SamplingParams
from trtssd.structured.grammar import Grammars

log = logging.getLogger(__name__)

__all__ = ["LLM", "RequestOutput"]


class LLM:
    """Target and draft for one engine.

    engine:  engine directory built by `trtssd build`; None = the embedded default engine
             (built on first use).
    target, draft: explicit model references instead of an engine (tests use tiny models).
    launch:  "spawn" starts the draft as its own MPI job (the default; survives a dying draft);
             "world" runs as a rank of an ``mpiexec -n T+1`` job, ranks 0..T-1 the target
             (T = tensor_parallel_size) and the last rank the draft; "local" runs the
             draft in this process, after each answer instead of during verification (same
             tokens, no overlap: for debugging and tests, never for speed; needs no mpi4py).
    Every other keyword is a field of SpeculativeConfig or RuntimeConfig (trtssd/config.py, where
    each carries its default and help; `trtssd generate --help` lists them all): what is not given
    comes from the engine manifest's tuned ``speculation``, then from the dataclasses' defaults.
    An unknown keyword is a TypeError naming the allowed ones. target_device / draft_device: "cpu"
    (default), "cuda" or "cuda:N"; each rank loads its model there (CUDA: unverified, never run on a GPU).
    verifier: "executor" (default: the target's own) or "trtllm": rounds verified by the TensorRT-LLM 1.2.x engine
             in ``trtllm_engine_dir`` (docs/tensorrt_llm.md; unverified: never run); prefill stays
             on the torch target.
    """

    def __init__(self, engine: str | None = None, *, target: ModelRef | None = None,
                 draft: ModelRef | None = None, launch: str = "spawn", **options):
        options = renamed_options(options)
        spec_opts = {k: options.pop(k) for k in list(options) if k in SpeculativeConfig.__dataclass_fields__}
        run_opts = {k: options.pop(k) for k in list(options) if k in RuntimeConfig.__dataclass_fields__}
        if options:
            allowed = sorted(set(SpeculativeConfig.__dataclass_fields__) | set(RuntimeConfig.__dataclass_fields__))
            raise TypeError(f"unknown LLM option(s) {sorted(options)}; allowed: {allowed}")
        if launch not in LAUNCHES:
            raise ValueError(f"launch must be one of {LAUNCHES}; got {launch!r}")
        try:
            self._init(engine, target, draft, launch, spec_opts, run_opts)
        except BaseException as err:
            if launch == "world":
                end_world_job(err)  # the job's other ranks wait for this one: end them with it
            raise

    def _init(self, engine: str | None, target: ModelRef | None, draft: ModelRef | None, launch: str,
              spec_opts: dict, run_opts: dict) -> None:
        self.spec = speculative_config(spec_opts)  # fails fast, before any engine is built
        runtime = RuntimeConfig(**run_opts)
        if runtime.target_cores is None and runtime.draft_cores is None:
            cores = split_cores(runtime.target_threads, runtime.draft_threads)
            runtime = dataclasses.replace(runtime, target_cores=cores[0], draft_cores=cores[1])
        self.runtime = runtime
        for name in ("target_device", "draft_device"):  # fail before anything starts, naming the option
            resolve_device(getattr(runtime, name), name)
        target, draft = resolve_models(engine, target, draft)
        self.spec = speculative_config(spec_opts, engine_speculation(target.path),
                                       defaults_from=f"{target.path}/{MANIFEST}")
        self._closed = True  # until everything below has started
        self._previous_affinity = pin("target", self.runtime.target_cores, self.runtime.target_threads)
        try:
            self.loop = self._start(target, draft, launch)
        except BaseException:
            restore(self._previous_affinity)
            raise
        self._closed = False
        self._handed_over = False

    def _start(self, target: ModelRef, draft: ModelRef, launch: str) -> TargetLoop:
        # T > 1: rank 0 of a tensor-parallel target, its followers started here (closed by close()).
        executor = start_target(target, self.spec, self.runtime, launch)
        link = verifier = None
        try:
            self.tokenizer = load_tokenizer(target.path)
            verifier = self._verifier(executor.vocab_size)
            if self.spec.mode is not Mode.AR:
                link = start_draft(launch, draft, self.spec, self.runtime, executor.vocab_size)
        except BaseException:
            _close_verifier(verifier)
            close_target(executor)
            raise
        rt = self.runtime
        lending = (core_lending(executor, rt.target_cores, rt.target_threads, rt.draft_cores, rt.draft_threads,
                                split_single_rows=rt.lend_draft_cores == "always")
                   if rt.lend_draft_cores != "never" else None)
        grammars = (Grammars(self.tokenizer, executor.vocab_size, _eos_ids(self.tokenizer))
                    if self.tokenizer is not None else None)
        # The round policy's calibration: timed forwards (seconds; stored per machine and model).
        costs = calibrate_target(executor, self.spec, rt.max_batch, link.step_s if link is not None else None, lending,
                                 executor_verifies=verifier is None)
        return TargetLoop(executor, self.spec, rt.max_batch, rt.max_model_len, _eos_ids(self.tokenizer), link,
                          verifier, lending, prefix_cache_seqs=rt.prefix_cache_seqs,
                          prefix_cache_mib=rt.prefix_cache_mib, prefill_chunk=rt.prefill_chunk,
                          grammars=grammars, costs=costs)

    def _verifier(self, vocab_size: int) -> Verifier | None:
        """The target's rounds: None = the torch executor's own (TargetLoop's default)."""
        if self.runtime.verifier is VerifierKind.EXECUTOR:
            return None
        # Injected from here: the runtime may not import the TensorRT-LLM layer, which sits on
        # top of it (tests/test_layering.py); that layer and tensorrt_llm are imported only now.
        from trtssd.trtllm.verifier import trtllm_verifier

        return trtllm_verifier(self.runtime.trtllm_engine_dir, vocab_size, self.runtime.tensor_parallel_size)

    # --- requests ----------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string or token id list")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return encode_text(self.tokenizer, prompt)
        ids = list(prompt)
        if not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt must be a non-empty string or a non-empty list of int token ids")
        return ids

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for a batch of prompts (list in, list out, same order): one `RequestOutput`
        per prompt, its ``outputs`` the ``SamplingParams.n`` samples (sample 0's in its own fields)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = _broadcast_params(params, len(prompts))
        loop = self._own_loop()
        # All or nothing: one bad prompt queues none.
        requests = [loop.new_sequences(self._encode(p), sp) for p, sp in zip(prompts, params_list)]
        texts = {}
        for samples in requests:
            for seq in samples:
                texts[seq.seq_id] = OutputText(self.tokenizer, seq.params.stop, seq.sample_index, seq.params.min_tokens)
                loop.add(seq)
        while loop.has_unfinished():
            for out in loop.step():
                self._text(out, texts[out.seq_id])
        for seq in texts:  # one a stop string ended (LLM._text) never reached the loop's finished ones
            loop.pop_finished(seq)
        return [request_output(samples, [texts[s.seq_id] for s in samples], p)
                for p, samples in zip(prompts, requests)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, per_token: bool = False) -> Iterator[str]:
        """Yield text deltas as tokens are committed: by default one delta per round (a
        speculative round commits its accepted tokens at once); ``per_token=True`` splits each
        round into one delta per token, for a steady typing cadence. Either way the deltas join
        to the final text: text that could still turn out to start a stop string is held back
        until it is known not to, so nothing yielded is ever taken back."""
        loop = self._own_loop()
        params = params or SamplingParams()
        if params.n != 1:
            raise FieldError("n", f"LLM.stream streams one sample; n = {params.n} needs LLM.generate or the server")
        seq = loop.new_sequence(self._encode(prompt), params)
        text = OutputText(self.tokenizer, seq.params.stop, min_tokens=seq.params.min_tokens)
        loop.add(seq)
        while seq.finish_reason is None:
            for out in loop.step():
                if out.seq_id != seq.seq_id:
                    continue
                delta = self._text(out, text)
                for piece in (delta.token_texts if per_token else (delta.text,)) if delta else ():
                    if piece:
                        yield piece
        loop.pop_finished(seq.seq_id)

    def _text(self, out, text: OutputText):
        """One output's text, between steps; a completed stop string ends its sequence now."""
        delta = text.add(out)
        if delta is not None and delta.stop_at is not None:
            self.loop.stop(out.seq_id)
        return delta

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """One assistant turn, with the model's chat template (through transformers)."""
        if not messages or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        return self.generate([chat_prompt_ids(self.tokenizer, messages)], params)[0]

    def hand_over(self) -> TargetLoop:
        """The started target loop, for a server that runs it in a thread of its own (the
        serving layer's AsyncLLM). From then on the server owns it: this LLM's own
        `generate` and `stream` refuse, and `close` still stops the draft and frees memory."""
        self._own_loop()
        self._handed_over = True
        return self.loop

    def _own_loop(self) -> TargetLoop:
        if self._closed:
            raise RuntimeError("this LLM is closed")
        if self._handed_over:
            raise RuntimeError("this LLM's target loop was handed to a server (LLM.hand_over): submit requests there")
        return self.loop

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens one request may hold (RuntimeConfig.max_model_len)."""
        return self.runtime.max_model_len

    @property
    def draft_state(self) -> str:
        """"none" (ar mode), "alive", or "lost" (the loop decodes in ar mode without it)."""
        if self.spec.mode is Mode.AR:
            return "none"
        return "alive" if self.loop.speculating else "lost"

    @property
    def metrics(self) -> SpeculationMetrics:
        """Aggregate metrics over every finished request."""
        return self.loop.metrics

    # --- lifecycle ---------------------------------------------------------------------------

    def leave_target_cores(self) -> None:
        """Move the calling thread off the target's cores, to the cores it had before this LLM
        less the target's. For a caller whose target loop runs in a thread of its own that pins
        itself to ``runtime.target_cores`` (a server's loop thread): the caller's own work
        (HTTP, streaming) must not take turns with the target on its core."""
        pin_thread("calling thread", cores_besides(self.runtime.target_cores, self._previous_affinity[0]))

    def close(self) -> None:
        """Stop the draft rank, free shared memory, give the process its CPU affinity back."""
        if self._closed:
            return
        self._closed = True
        if self.loop.draft is not None:
            self.loop.draft.close()
        _close_verifier(self.loop.verifier)
        close_target(self.loop.target)
        restore(self._previous_affinity)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _close_verifier(verifier) -> None:
    """Shut down a verifier that holds an engine of its own (TensorRT-LLM's executor); the
    default one uses the loop's executor and has nothing to close."""
    close = getattr(verifier, "close", None)
    if close is not None:
        close()


def _broadcast_params(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _eos_ids(tokenizer) -> tuple[int, ...]:
    if tokenizer is None or tokenizer.eos_token_id is None:
        return ()
    return (int(tokenizer.eos_token_id),)
