"""The benchmark configuration and the plan of which system instances run which cells."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from trtssd.engines import resolve_models
from trtssd.bench.prompts import BUILTIN_SETS
from trtssd.bench.records import RunKey
from trtssd.config import ModelRef, check_device, speculative_config
from trtssd.models.engine_dir import engine_speculation

log = logging.getLogger(__name__)


# sd and ssd speculate every round; "auto" is ssd under load control (trtssd/runtime/load_control.py):
# each round speculates or decodes plainly (on the draft's cores too), whichever measured faster.
TRTSSD_SYSTEMS = ("ar", "sd", "ssd", "auto")
HF_SYSTEMS = ("hf-greedy", "hf-assisted")
# llama.cpp's llama-server on the engine's GGUF files: plain decoding, and with the draft GGUF.
LLAMACPP_SYSTEMS = ("llama.cpp", "llama.cpp-sd")
ALL_SYSTEMS = TRTSSD_SYSTEMS + HF_SYSTEMS + LLAMACPP_SYSTEMS


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
    # Lookaheads for sd, ssd and hf-assisted, and fan-out budgets for ssd ("auto" fan-out within
    # each); empty: the engine's tuned ones (its manifest's speculation, else LLM's defaults).
    ks: tuple[int, ...] = ()
    budgets: tuple[int, ...] = ()
    backup: str = "auto"  # ssd miss policy
    saguaro_c: float | None = None  # ssd's cache-aware sampling scale; None: the engine's (else LLM's default)
    ignore_eos: bool = True  # generate exactly max_tokens so every system does the same work
    seed: int = 0  # sampling seed base (temperature > 0)
    warmup: bool = True  # one short untimed request per loaded system
    peer_threads: int = 1  # torch threads for the transformers peers (trtssd: one per rank)
    # llama-server threads: the target's, and in llama.cpp-sd the draft's too (it runs the two
    # in turn in one process); 1 matches trtssd's one core per rank.
    llamacpp_threads: int = 1
    # llama.cpp-sd's draft lengths (--spec-draft-n-max), one row each; empty: the same as ks.
    llamacpp_draft_max: tuple[int, ...] = ()
    shared_cores: bool = False  # trtssd ranks each get every core (threads = cores), shared
    lend_draft_cores: str = "exact"  # RuntimeConfig.lend_draft_cores of the trtssd systems
    hf_target: str | None = None  # override: transformers source of the target (dir or .gguf)
    hf_draft: str | None = None  # override: transformers source of the assistant
    calibrate: bool = True  # time forward passes afterwards and compare the plan with the runs
    handshake_s: float | None = None  # plan: fixed handshake instead of the one inferred from sd runs
    out_dir: Path = Path("bench-out")
    plots: bool = True
    target_device: str = "cpu"  # the trtssd systems' target rank: "cpu", "cuda", "cuda:N" (CUDA: unverified)
    draft_device: str = "cpu"  # and their draft rank (the transformers peers and calibration stay on the CPU)
    # More trtssd.LLM keywords for every trtssd system (draft_timeout_s, cores, transport, ...);
    # each run's own mode, K, budget and sizes, and the fields above, override them.
    llm_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [s for s in self.systems if s not in ALL_SYSTEMS]
        if bad or not self.systems:
            raise ValueError(f"systems must be a non-empty subset of {ALL_SYSTEMS}; got {list(self.systems)}")
        if self.engine is not None and self.target is not None:
            raise ValueError("give either engine or target/draft, not both")
        if self.draft is not None and self.target is None:
            raise ValueError("draft needs target")
        for name in ("batch_sizes", "ks", "budgets", "llamacpp_draft_max"):
            values = getattr(self, name)
            if (name == "batch_sizes" and not values) or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be a {'non-empty ' if name == 'batch_sizes' else ''}list of ints >= 1; "
                                 f"got {values!r}")
        if not self.temperatures or any(not 0 <= t <= 10 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of numbers in [0, 10]; got {self.temperatures!r}")
        if min(self.max_tokens, self.prompts_per_set, self.peer_threads, self.llamacpp_threads) < 1:
            raise ValueError("max_tokens, prompts_per_set, peer_threads and llamacpp_threads must be >= 1")
        if self.saguaro_c is not None and not 0.0 < self.saguaro_c <= 1.0:
            raise ValueError(f"saguaro_c must be in (0, 1]; got {self.saguaro_c!r}")
        if self.backup not in ("auto", "neural", "fast"):
            raise ValueError(f"backup must be 'auto', 'neural' or 'fast'; got {self.backup!r}")
        for name in ("target_device", "draft_device"):
            check_device(getattr(self, name), name)

    def model_refs(self):
        """(target, draft) ModelRefs exactly as the LLM resolves them."""
        target = ModelRef(self.target) if self.target else None
        draft = ModelRef(self.draft) if self.draft else None
        return resolve_models(self.engine, target, draft)

    def resolved(self) -> "BenchConfig":
        """This config with empty ks / budgets made the engine's own (what an LLM of this engine
        runs with when given none)."""
        if self.ks and self.budgets:
            return self
        spec = speculative_config({}, engine_speculation(self.model_refs()[0].path))
        return replace(self, ks=self.ks or (spec.k,), budgets=self.budgets or (spec.fanout_budget,))


@dataclass(frozen=True)
class Instance:
    """One loaded system and the cells it runs (trtssd: one LLM per mode/K/budget)."""

    system: str  # "ar", "sd", "ssd", "auto", "hf" (both transformers peers share the loaded models), "llama.cpp", "llama.cpp-sd"
    k: int | None
    budget: int | None
    keys: tuple[RunKey, ...]


def plan_instances(cfg: BenchConfig) -> list[Instance]:
    """Group the sweep's cells by the system instance that runs them."""
    cfg = cfg.resolved()
    cells = []
    for system in cfg.systems:
        ks = cfg.ks if system in ("sd", "ssd", "auto", "hf-assisted") else (None,)
        if system == "llama.cpp-sd":  # K = its draft length; each K is its own server
            ks = cfg.llamacpp_draft_max or cfg.ks
        budgets = cfg.budgets if system in ("ssd", "auto") else (None,)
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
