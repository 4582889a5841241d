"""Configuration as frozen dataclasses; every default says why it is what it is."""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


class Mode(str, enum.Enum):
    """How tokens are produced. One enum instead of scattered boolean flags."""

    AR = "ar"  # plain autoregressive decoding on the target; no draft, no speculation code on the path
    SD = "sd"  # ordinary speculative decoding: draft K tokens, then verify (sequential)
    SSD = "ssd"  # Saguaro: the draft pre-speculates for likely outcomes while the target verifies


class Backup(str, enum.Enum):
    """What answers a cache miss in SSD mode (docs/algorithm.md section 4)."""

    AUTO = "auto"  # choose per round from measured costs, hit rate and batch size
    NEURAL = "neural"  # the draft drafts K tokens just in time for the missing rows
    FAST = "fast"  # n-gram / prompt-lookup proposal, verified as a point mass (still exact)


class Source(str, enum.Enum):
    """Where a verified speculation came from (metrics, protocol and cost model use the same names)."""

    HIT = "hit"  # SSD: the pre-speculation cache held the actual outcome
    NEURAL = "neural"  # cache miss answered by the draft just in time
    FAST = "fast"  # cache miss answered by an n-gram proposal (a point mass)
    SD = "sd"  # plain speculative decoding: drafted after the outcome was known (no cache)


class Transport(str, enum.Enum):
    """How the draft's proposal rows reach the target (trtssd/runtime/transport.py)."""

    AUTO = "auto"  # cuda_ipc when the draft runs on CUDA, else host
    HOST = "host"  # shared host memory (POSIX shared memory or an MPI-3 window)
    CUDA_IPC = "cuda_ipc"  # a device buffer on the draft's GPU, mapped by the target through CUDA IPC


class VerifierKind(str, enum.Enum):
    """What verifies the draft's rows on the target rank (trtssd/runtime/verifiers.py); prefill
    stays on the target's executor."""

    EXECUTOR = "executor"  # the target's own executor (trtssd/backends/: torch or ggml)
    TRTLLM = "trtllm"  # a TensorRT-LLM 1.2.x engine through its Executor API (trtssd/trtllm/; unverified)


def check_device(value: object, field_name: str) -> str:
    """A device name as a string ("cpu", "cuda", "cuda:N"), checked for form only: whether CUDA
    is present is asked when the device is used (trtssd/devices.py), so a configuration can be
    written on a machine without the GPU it names (a Triton repository for a GPU host)."""
    if isinstance(value, str):
        if value in ("cpu", "cuda"):
            return value
        head, _, index = value.partition(":")
        if head == "cuda" and index.isdigit() and str(int(index)) == index:
            return value
    raise ValueError(f"{field_name} must be 'cpu', 'cuda' or 'cuda:N' (N a device index); got {value!r}")


def _opt(default: Any, help: str, **cli: Any) -> Any:
    """A field with its default and the help text of its command-line option (trtssd/cli_options.py
    makes one option per field); ``cli``: more of that option's metadata (``choices``)."""
    return field(default=default, metadata={"help": help, **cli})


def _choice(enum_cls, value, field_name: str):
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"{field_name} must be one of {allowed}; got {value!r}") from None


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculation settings, shared by the target (verification) and the draft (speculation)."""

    # ssd is the product's point; ar and sd exist for honest comparison.
    mode: Mode = _opt(Mode.SSD, "ar: plain decoding; sd: draft, then verify; ssd: the draft pre-speculates while "
                      "the target verifies")
    # The K sweep (docs/bench/sweep) peaks at K=7; 5 is within 9% of it and safer at low acceptance.
    k: int = _opt(5, "lookahead: tokens the draft proposes per round")
    # "auto": each round, the budget (1..fanout_budget branches per sequence) with the best
    # predicted tokens/s from measured draft forward and verify times (docs/algorithm.md section 8),
    # spread over depths by section 7 from online a, c and r. Or K+1 explicit ints.
    fanout: str | tuple[int, ...] = _opt("auto", "'auto' (branches chosen each round within the fan-out budget) "
                                         "or K+1 comma-separated branch counts, one per depth")
    fanout_budget: int = _opt(12, "most branches per sequence per round with fan-out 'auto'")
    saguaro_c: float = _opt(0.7, "cache-aware scaling of the draft's top candidates, in (0, 1]; 1 = plain sampling")
    backup: Backup = _opt(Backup.AUTO, "what answers a cache miss: auto (chosen from measured costs), neural (the "
                          "draft, just in time) or fast (an n-gram proposal)")
    draft_timeout_s: float = _opt(30.0, "no draft reply within this many seconds: the draft is declared dead and "
                                  "decoding goes on without it")
    # Decode rounds without the draft when plain rounds measure faster at the current batch size
    # (speculation costs at high concurrency); never while a seeded sampled request runs, whose
    # seed promises the same output at any load.
    plain_under_load: bool = _opt(True, "decode plainly in rounds where that measured faster at the batch size")
    # The verify costs B x (k+1) rows: at large batch the last positions stop paying for theirs.
    k_per_round: bool = _opt(False, "verify the first 1..k proposals each round, as many as the best predicted "
                             "tokens/s at the batch size from live acceptance and verify times")

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _choice(Mode, self.mode, "mode"))
        object.__setattr__(self, "backup", _choice(Backup, self.backup, "backup"))
        if not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise ValueError(f"k must be an integer in [1, 16]; got {self.k!r}")
        if isinstance(self.fanout, str):
            if self.fanout != "auto":
                raise ValueError(f"fanout must be 'auto' or a list of {self.k + 1} non-negative ints; got {self.fanout!r}")
        else:
            fan = tuple(self.fanout)
            if len(fan) != self.k + 1 or any((not isinstance(f, int)) or f < 0 for f in fan):
                raise ValueError(f"fanout must be 'auto' or a list of k+1={self.k + 1} non-negative ints; got {self.fanout!r}")
            object.__setattr__(self, "fanout", fan)
        if not isinstance(self.fanout_budget, int) or not 1 <= self.fanout_budget <= 256:
            raise ValueError(f"fanout_budget must be an integer in [1, 256]; got {self.fanout_budget!r}")
        if not 0.0 < self.saguaro_c <= 1.0:
            raise ValueError(f"saguaro_c must be in (0, 1]; got {self.saguaro_c!r}")
        if not self.draft_timeout_s > 0:
            raise ValueError(f"draft_timeout_s must be > 0; got {self.draft_timeout_s!r}")
        for name in ("plain_under_load", "k_per_round"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")

    @property
    def fixed_fanout(self) -> tuple[int, ...] | None:
        """The explicit per-depth fan-out, or None when it is chosen each round ("auto")."""
        return self.fanout if isinstance(self.fanout, tuple) else None

    @property
    def budget(self) -> int:
        """Branches per sequence per round."""
        return sum(self.fixed_fanout) if self.fixed_fanout is not None else self.fanout_budget


def speculative_config(given: Mapping[str, Any], defaults: Mapping[str, Any] | None = None,
                       defaults_from: str = "the engine") -> SpeculativeConfig:
    """The speculation settings: the options given, over an engine's tuned defaults (its
    manifest's ``speculation``), over SpeculativeConfig's own. An explicit fanout fixes K when K
    is not given, so a fanout given alone never meets an engine's different K."""
    defaults = dict(defaults or {})
    unknown = sorted(set(defaults) - set(SpeculativeConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{defaults_from}: unknown speculation setting(s) {unknown}; "
                         f"allowed: {sorted(SpeculativeConfig.__dataclass_fields__)}")
    merged = {**defaults, **given}
    fanout = given.get("fanout")
    if fanout is not None and not isinstance(fanout, str) and "k" not in given and len(tuple(fanout)) >= 2:
        merged["k"] = len(tuple(fanout)) - 1  # shorter: SpeculativeConfig names fanout in its error
    return SpeculativeConfig(**merged)


LEND_DRAFT_CORES = ("exact", "always", "never")
KEPT_SEQUENCES = 8  # the prefix cache's kept prompts on a torch rank when prefix_cache_seqs is unset

# Options renamed so that each word means one thing (docs/layout.md, glossary): old name -> new.
# The old names keep working for one release, with a deprecation warning.
RENAMED_OPTIONS = {"max_seq_len": "max_model_len", "target_backend": "verifier"}
# Values an old name took that its new one names otherwise.
RENAMED_VALUES = {"target_backend": {"torch": "executor"}}


def renamed_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` with each deprecated option name replaced by its new one (a FutureWarning each,
    which Python shows by default); an option given under both names is a ValueError naming both."""
    options = dict(given)
    for old, new in RENAMED_OPTIONS.items():
        if old in options:
            if new in options:
                raise ValueError(f"{new} and its deprecated name {old} were both given: give {new} only")
            warnings.warn(f"option {old} is deprecated: use {new}", FutureWarning, stacklevel=3)
            value = options.pop(old)
            options[new] = RENAMED_VALUES.get(old, {}).get(value, value)
    return options


@dataclass(frozen=True)
class RuntimeConfig:
    """Process layout and capacity."""

    max_batch: int = _opt(8, "sequences in flight at once")
    max_model_len: int = _opt(2048, "prompt + output tokens one request may hold (room for speculation is added on "
                              "top); was --max-seq-len, which still works for one release")
    # One process per target rank; more than one splits the torch target Megatron-style over
    # torch.distributed (trtssd/backends/tensor_parallel.py), so a model too big for one device runs.
    tensor_parallel_size: int = _opt(1, "target ranks: the torch target split over this many processes (gloo on CPU, "
                                     "NCCL on CUDA); must divide the model's attention and KV heads")
    # Where kept prompts wait decides what bounds them: llama.cpp copies them to host memory
    # (prefix_cache_mib), torch keeps each as a KV-pool sequence (KEPT_SEQUENCES more in the pool).
    prefix_cache_seqs: int | None = _opt(None, "finished requests whose prompt KV each rank keeps for reuse by a "
                                         "request repeating its prefix (prefix caching; least recently used go "
                                         f"first); 0: off; unset: as many as fit, {KEPT_SEQUENCES} on a torch rank "
                                         "(each a sequence of its KV pool), --prefix-cache-mib of host memory on a "
                                         "llama.cpp rank")
    prefix_cache_mib: int = _opt(2048, "host memory (MiB) the kept prompts of a llama.cpp rank may take (there a "
                                 "kept prompt's KV is copied out of llama.cpp's cache)")
    prefill_chunk: int = _opt(256, "most prompt tokens prefilled per step: a longer prompt is prefilled over several "
                              "steps between rounds of the running batch (chunked prefill); 0: whole prompts")
    target_threads: int = _opt(1, "torch threads on the target rank (CPU)")
    draft_threads: int = _opt(1, "torch threads on the draft rank (CPU)")
    target_cores: Sequence[int] | None = _opt(None, "comma-separated CPU cores to pin the target to "
                                              "(default: core 0 when there is more than one)")
    draft_cores: Sequence[int] | None = _opt(None, "comma-separated CPU cores to pin the draft to (default: the last)")
    poll_interval_s: float = _opt(0.0002, "seconds an idle rank sleeps between polls instead of spinning")
    # The draft idles during plain rounds. "exact" keeps a one-row forward over a long cache on one
    # thread; "always" is faster, but greedy output may then differ from sd/ssd at near-ties.
    lend_draft_cores: str = _opt("exact", "plain rounds of a ggml target on the draft's cores too: exact (rows stay "
                                 "bit-identical), always (also llama.cpp's own multi-thread decoding) or never",
                                 choices=LEND_DRAFT_CORES)
    # Batch invariance: a ggml target's rows keep the same sums alone and in any batch
    # (trtssd/backends/ggml_backend.py), so greedy output is the same in every mode and at every
    # load, bit for bit. Off, forwards go to llama.cpp whole, as llama-server sends them.
    row_invariant: bool = _opt(True, "a ggml target computes each row the same whatever its batch (greedy output "
                               "equal across modes and loads, bit for bit); off: llama.cpp's own batching, faster "
                               "at 8+ rows on K-quant files, greedy output may differ at near-ties (sampled output "
                               "keeps the target's distribution either way)")
    target_device: str = _opt("cpu", "'cpu', 'cuda' or 'cuda:N': where the target's weights, KV pool and forwards "
                              "live (CUDA: unverified)")
    draft_device: str = _opt("cpu", "the same for the draft rank (on one GPU both ranks may share it)")
    transport: Transport = _opt(Transport.AUTO, "how the draft's rows reach the target: auto (cuda_ipc when the "
                                "draft is on CUDA), host or cuda_ipc")
    verifier: VerifierKind = _opt(VerifierKind.EXECUTOR, "what verifies rounds on the target: executor (the "
                                  "target's own, torch or ggml) or trtllm (a TensorRT-LLM engine; unverified); was "
                                  "--target-backend torch|trtllm, which still works for one release")
    trtllm_engine_dir: str | None = _opt(None, "the TensorRT-LLM target engine (with the trtllm target backend only; "
                                         "`trtssd build --backend trtllm` writes its build script)")

    def __post_init__(self) -> None:
        for name in ("target_device", "draft_device"):
            object.__setattr__(self, name, check_device(getattr(self, name), name))
        object.__setattr__(self, "transport", _choice(Transport, self.transport, "transport"))
        if self.transport is Transport.CUDA_IPC and not self.draft_device.startswith("cuda"):
            raise ValueError(f"transport 'cuda_ipc' needs draft_device 'cuda' or 'cuda:N' (the buffer lives on the "
                             f"draft's GPU); got draft_device {self.draft_device!r}")
        object.__setattr__(self, "verifier", _choice(VerifierKind, self.verifier, "verifier"))
        if (self.verifier is VerifierKind.TRTLLM) != (self.trtllm_engine_dir is not None):
            raise ValueError("trtllm_engine_dir is required with verifier 'trtllm' and allowed only with it; got "
                             f"verifier {self.verifier.value!r}, trtllm_engine_dir {self.trtllm_engine_dir!r}")
        for name in ("max_batch", "max_model_len", "target_threads", "draft_threads", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        for name in ("prefix_cache_seqs", "prefix_cache_mib", "prefill_chunk"):
            v = getattr(self, name)
            if name == "prefix_cache_seqs" and v is None:
                continue  # unset: as many as fit
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer; got {v!r}")
        if self.lend_draft_cores not in LEND_DRAFT_CORES:
            raise ValueError(f"lend_draft_cores must be one of {LEND_DRAFT_CORES}; got {self.lend_draft_cores!r}")
        if not 0 < self.poll_interval_s <= 0.1:
            raise ValueError(f"poll_interval_s must be in (0, 0.1]; got {self.poll_interval_s!r}")
        for name in ("target_cores", "draft_cores"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(int(c) for c in v))

    @property
    def kept_sequences(self) -> int:
        """Sequences a torch executor's KV pool holds for kept prompts, besides the running ones."""
        return KEPT_SEQUENCES if self.prefix_cache_seqs is None else self.prefix_cache_seqs

    @property
    def resolved_transport(self) -> Transport:
        """The transport in use: "auto" made concrete (CUDA IPC exactly when the draft is on CUDA)."""
        if self.transport is not Transport.AUTO:
            return self.transport
        return Transport.CUDA_IPC if self.draft_device.startswith("cuda") else Transport.HOST


@dataclass(frozen=True)
class ModelRef:
    """A model one rank loads by itself (picklable, so the target can tell the draft what to load)."""

    path: str  # engine directory, Hugging Face directory (config.json + safetensors) or .gguf file
    side: str = "target"  # for engine directories: which model, "target" or "draft"
    dtype: str = "float32"  # compute dtype of the torch backend ("float32" or "bfloat16")
    backend: str = "torch"  # for a .gguf file: "torch" (the reference engine) or "ggml" (llama.cpp, as it is)

    def __post_init__(self) -> None:
        if self.side not in ("target", "draft"):
            raise ValueError(f"side must be 'target' or 'draft'; got {self.side!r}")
        if self.backend not in ("torch", "ggml"):
            raise ValueError(f"backend must be 'torch' or 'ggml'; got {self.backend!r}")
        if self.backend == "ggml" and not str(self.path).endswith(".gguf"):
            raise ValueError(f"backend 'ggml' runs a .gguf file; got path {self.path!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16'; got {self.dtype!r}")


def batch_tokens(spec: SpeculativeConfig, runtime: RuntimeConfig) -> int:
    """Tokens one forward may hold: a whole prompt, or every row's verify/glue/tree block."""
    return runtime.max_model_len + runtime.max_batch * (spec.budget + 2 * (spec.k + 1))
