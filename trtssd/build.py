"""Building engine directories: a target and a draft model, prepared once, loaded fast by each rank
(reading them back is ``trtssd.models.engine_dir`` and ``trtssd.backends.loading``).

``build_engine`` turns a model reference (a named engine of ``trtssd.models.catalog`` such as the
default "smollm2-135m" or "qwen2.5-coder-1.5b", or a GGUF file / Hugging Face directory, with an
optional second one as the draft) into ``<out_dir>/<name>/``::

    manifest.json           what was built, from what, how, and what each side runs as
    target/model.gguf       the target's GGUF, as given (hard link or copy); the torch backend
                            dequantizes it at load time (or target/: a Hugging Face directory)
    draft/model.safetensors the int4 self-draft: 4-bit groups of every projection
                            (``int4.<linear>.codes|scales|mins``) and the remaining fp32
                            parameters (``param.<name>``: embedding, norms, biases)
    draft/model.gguf        or: a separate draft model, run by torch like the target
                            (or draft/: a Hugging Face directory)
    target/int8.safetensors a side run with int8 projections (target_dtype / draft_dtype "int8",
    draft/int8.safetensors  trtssd.models.int8_dynamic): ``int8.<linear>.codes|scales`` and the
                            remaining fp32 parameters (``param.<name>``), so loading only packs
                            them; the side's model file stays (CUDA devices run it in fp32)
    tokenizer/              the Hugging Face tokenizer of the target (from its GGUF metadata,
                            chat template included, or from its directory)

The int4 self-draft is the target's own Q4_1 weights run by torch's int4 kernel
(trtssd.models.quant); see docs/draft.md for why. A separate draft (another, smaller model with
the same tokenizer) runs its dequantized weights in ``draft_dtype``, or in int8
(trtssd.models.int8_dynamic). Building is idempotent: when
manifest.json records the same inputs (source hashes, options, format and build-code hashes) and
the outputs still hash as recorded, nothing is done. The target and draft tokenizers must be
identical (GGUF pairs: vocabulary, token types, merges, special tokens; otherwise vocabulary and
merges), and so must their vocabulary rows, else ``TokenizerMismatchError``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from trtssd.config import speculative_config
from trtssd.hashing import file_sha256
from trtssd.kernels.draft_layers import DEFAULT_MAX_TOKENS as FUSED_MAX_TOKENS
from trtssd.kernels.cpu_extension import load_extension
from trtssd.models.config import ModelConfig
from trtssd.models.catalog import DEFAULT_ENGINE, NAMED_ENGINES
from trtssd.models.engine_dir import (
    DRAFT_DIR, DRAFT_FILE, DRAFT_GGUF, DRAFT_INT8, FORMAT_VERSION, MANIFEST, TARGET_DIR, TARGET_FILE, TARGET_INT8,
    TOKENIZER_DIR,
)
from trtssd.models.int8_dynamic import int8_checkpoint
from trtssd.models.loader import (
    GGUFTensor, gguf_config, gguf_sources, is_gguf, load_config, load_state_dict, read_gguf, unpermute_rows,
)
from trtssd.models.quant import gguf_linear_groups, pack_nibbles
from trtssd.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_HEAD_TOP_K = 16  # draft logits re-scored exactly in fp32 (docs/draft.md: agreement 0.90 -> ~1.0)
# Code whose change alters what a build produces: its hash is part of the no-op check.
_BUILD_CODE = ("build.py", "models/quant.py", "models/int8_dynamic.py", "models/loader.py", "models/dequant.py",
               "models/config.py")
_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
)
TORCH_DTYPES = ("float32", "bfloat16")
TARGET_DTYPES = (*TORCH_DTYPES, "int8")  # "int8": int8 projections with two activation levels
DRAFT_DTYPES = ("int4", "int8", *TORCH_DTYPES)  # "int4": 4-bit groups from a GGUF; "int8": int8 projections
# What runs both sides: "ggml" runs the GGUF files as they are on llama.cpp (the fast CPU engine);
# "torch" is the reference engine (our model code; its dtypes above; the CUDA path).
BACKENDS = ("ggml", "torch")
# int8 activation levels per side (trtssd.models.int8_dynamic): the target defines the output, so
# it takes ~14-bit activations; the draft only proposes, and one 7-bit level is cheaper.
TARGET_INT8_LEVELS = 2
DRAFT_INT8_LEVELS = 1
# What of a Hugging Face model directory an engine keeps (its tokenizer is saved separately).
_HF_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


class TokenizerMismatchError(ValueError):
    """Target and draft do not tokenize identically, so draft tokens would mean other text."""


@dataclass(frozen=True)
class Recipe:
    """What an engine is built from, and what each side runs as."""

    name: str  # engine directory name under out_dir
    target: Path  # GGUF file or Hugging Face directory of the target model
    draft: Path  # same for the draft (the target itself: self-draft)
    backend: str = "torch"  # one of BACKENDS; "ggml" needs GGUF files and ignores the dtypes
    target_dtype: str = "float32"  # the target's compute dtype, or "int8" (it defines exactness)
    draft_dtype: str = "int4"  # "int4": 4-bit groups from a GGUF's weights; "int8"; else torch dtype
    plain_weights: bool = True  # fp32 linears keep plain weights next to oneDNN's (2x memory)
    head_top_k: int = DEFAULT_HEAD_TOP_K  # int4 draft output rows re-scored in fp32 (0 = none)
    # SpeculativeConfig defaults measured for this pair (K, fan-out budget, ...); the manifest
    # carries them and LLM applies what its caller does not set.
    speculation: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"engine name must be a plain directory name, got {self.name!r}")
        if not isinstance(self.head_top_k, int) or self.head_top_k < 0:
            raise ValueError(f"head_top_k must be a non-negative int, got {self.head_top_k!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "ggml":
            for role, path in (("target", self.target), ("draft", self.draft)):
                if not is_gguf(path):
                    raise ValueError(f"the ggml backend runs GGUF files; the {role} {path} is not a .gguf file "
                                     "(build it with backend='torch')")
        if self.target_dtype not in TARGET_DTYPES:
            raise ValueError(f"target_dtype must be one of {TARGET_DTYPES}, got {self.target_dtype!r}")
        if self.draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"draft_dtype must be one of {DRAFT_DTYPES}, got {self.draft_dtype!r}")
        if self.backend == "torch" and self.draft_dtype == "int4" and not is_gguf(self.draft):
            raise ValueError(f"the int4 draft is made from a GGUF's weights; {self.draft} is not a .gguf file "
                             f"(give draft_dtype={TORCH_DTYPES[0]!r} to run it by torch)")
        speculative_config({}, self.speculation, defaults_from=f"engine {self.name!r}")  # a bad value fails the build

    @property
    def self_draft(self) -> bool:
        return self.draft == self.target


# -- references ------------------------------------------------------------------------------


REGISTERED = tuple(NAMED_ENGINES)  # engine names that resolve to models fetched on demand


def _model_path(ref: str | os.PathLike, role: str) -> Path:
    """A GGUF file or a Hugging Face model directory, checked to exist."""
    path = Path(ref).expanduser().resolve()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"{role} GGUF file not found: {path}")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{role} {path}: a directory without config.json is not a Hugging Face directory")
        return path
    raise FileNotFoundError(f"{role} must be a .gguf file or a Hugging Face model directory, got {path}")


def resolve_recipe(
    name_or_ref: str | os.PathLike = DEFAULT_ENGINE,
    *,
    draft: str | os.PathLike | None = None,
    name: str | None = None,
    head_top_k: int = DEFAULT_HEAD_TOP_K,
    target_dtype: str | None = None,
    draft_dtype: str | None = None,
    plain_weights: bool | None = None,
    backend: str | None = None,
) -> Recipe:
    """A named engine (``trtssd.models.catalog``; its models are fetched on first use), or a GGUF
    file / Hugging Face directory as the target → Recipe. ``draft``: another model as the draft
    (same tokenizer) instead of the named engine's or the target's own int4 weights. ``name``:
    engine directory name (default: the engine's name, or the target's file/directory stem,
    lower-cased). ``target_dtype`` (default: the named engine's, else "float32"), ``draft_dtype``
    (default: the named engine's; "int4" for a self-draft, else "float32") and ``plain_weights``
    override the defaults. ``backend`` (one of BACKENDS, default "torch"): what runs both sides; a
    ggml engine is named ``<name>-ggml`` by default, so it never replaces the torch engine of the
    same models."""
    ref = str(name_or_ref)
    named = NAMED_ENGINES.get(ref)
    if named is not None:
        target, default_name = named.target(), ref
    elif ref.endswith(".gguf") or Path(ref).is_dir():
        target = _model_path(ref, "target")
        default_name = target.stem.lower()
    else:
        known = ", ".join(map(repr, REGISTERED))
        raise ValueError(f"unknown engine name {ref!r}; known: {known}, or give a .gguf file or a Hugging Face directory")
    if draft is not None:  # another model drafts, run by torch unless told otherwise
        draft_path, default_draft_dtype = _model_path(draft, "draft"), TORCH_DTYPES[0]
    elif named is not None and named.draft is not None:
        draft_path, default_draft_dtype = named.draft(), named.draft_dtype
    else:  # the target drafts for itself, in int4
        draft_path, default_draft_dtype = target, "int4"
    backend = backend or "torch"
    if backend == "ggml" and (target_dtype is not None or draft_dtype is not None):
        raise ValueError("target_dtype and draft_dtype are torch-backend options; the ggml backend runs the "
                         "GGUF files' own types")
    if backend == "ggml":
        default_name += "-ggml"
    tuned = named.speculation.get(backend, {}) if named is not None and draft is None else {}
    return Recipe(
        name or default_name, target, draft_path, backend=backend,
        target_dtype=target_dtype or (named.target_dtype if named is not None else "float32"),
        draft_dtype=draft_dtype or default_draft_dtype,
        plain_weights=plain_weights if plain_weights is not None else (named.plain_weights if named is not None else True),
        head_top_k=head_top_k,
        # Tuned for the named pair on this backend: another draft gets SpeculativeConfig's own defaults.
        speculation=dict(tuned),
    )


def default_engines_dir() -> Path:
    """``engines/`` of the source checkout when trtssd runs from one, else ~/.cache/trtssd/engines."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "engines").is_dir():
        return root / "engines"
    return Path.home() / ".cache" / "trtssd" / "engines"


def default_engine(out_dir: str | os.PathLike | None = None) -> Path:
    """The default engine directory, built on first use."""
    return build_engine(DEFAULT_ENGINE, out_dir)


# -- build-code hashes and tokenizer identity ---------------------------------------------


def _code_hashes() -> dict[str, str]:
    pkg = Path(__file__).resolve().parent
    return {f"trtssd/{rel}": file_sha256(pkg / rel) for rel in _BUILD_CODE}


def gguf_tokenizer_fields(path: Path) -> dict[str, Any]:
    """The tokenizer-defining metadata of a GGUF file (absent keys are left out)."""
    metadata = read_gguf(path, arrays=_TOKENIZER_KEYS).metadata
    return {key: metadata[key] for key in _TOKENIZER_KEYS if key in metadata}


def transformers_tokenizer_fields(path: Path) -> dict[str, Any]:
    """What decides the token ids of a model's transformers tokenizer, whatever its format: the
    vocabulary (added tokens included) and, for BPE, the merges. Empty when it has none."""
    tok = load_tokenizer(path)
    if tok is None:
        return {}
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"model.type": model.get("type"), "vocab": tok.get_vocab(), "merges": merges}


def tokenizer_fields(target: Path, draft: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Comparable tokenizer fields of a target and a draft: GGUF metadata when both are GGUF
    files (exact and fast), else what their transformers tokenizers are made of."""
    if is_gguf(target) and is_gguf(draft):
        fields = gguf_tokenizer_fields(target)
        return fields, fields if draft == target else gguf_tokenizer_fields(draft)
    fields = transformers_tokenizer_fields(target)
    return fields, fields if draft == target else transformers_tokenizer_fields(draft)


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"first difference at index {i}: {x!r} vs {y!r}"
        return f"lengths {len(a)} vs {len(b)}"
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys(), key=str):
            if a.get(key) != b.get(key):
                return f"first difference at {key!r}: {a.get(key)!r} vs {b.get(key)!r}"
    return f"{a!r} vs {b!r}"


def check_same_tokenizer(target: Mapping[str, Any], draft: Mapping[str, Any], target_name: str, draft_name: str) -> None:
    """Raise TokenizerMismatchError naming the first field that differs."""
    for key in dict.fromkeys([*target, *draft]):  # both sides' keys, in their order
        a, b = target.get(key), draft.get(key)
        if a != b:
            raise TokenizerMismatchError(
                f"tokenizers of target {target_name} and draft {draft_name} differ in {key}: "
                f"{_first_difference(a, b)}. A draft must use exactly the target's tokenizer."
            )


def check_same_vocab_rows(target: ModelConfig, draft: ModelConfig, target_name: str, draft_name: str) -> None:
    """The runtime compares draft and target distributions row for row: equal vocabulary sizes
    (embedding rows, which may exceed the tokenizer's tokens) are required too."""
    if target.vocab_size != draft.vocab_size:
        raise TokenizerMismatchError(
            f"target {target_name} has {target.vocab_size} vocabulary rows, draft {draft_name} "
            f"{draft.vocab_size}: a draft must have exactly the target's vocabulary."
        )


def tokenizer_sha256(fields: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


# -- the draft file ----------------------------------------------------------------------------


def _plain_params(gguf, cfg: ModelConfig, linear_names: set[str]) -> dict[str, torch.Tensor]:
    """fp32 parameters that are not 4-bit projections: embedding, norms, biases, and an untied
    lm_head's exact weight (the draft head re-scores its top candidates with it)."""
    out = {}
    for param, sources in gguf_sources(cfg).items():
        module = param.rpartition(".")[0]
        if module in linear_names and param.endswith(".weight") and module != "lm_head":
            continue
        parts = []
        for src in sources:
            if src.name not in gguf.tensors:
                raise ValueError(f"{gguf.path}: GGUF tensor {src.name!r} is missing")
            t = gguf.tensors[src.name]
            if src.unpermute_heads is not None:
                t = GGUFTensor(t.name, t.qtype, t.shape, unpermute_rows(t.data, src.unpermute_heads))
            parts.append(t.dequantize())
        out[param] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out


def _write_draft(source: Path, dest: Path, progress: bool) -> dict:
    """Quantize ``source`` (GGUF) into the draft safetensors; returns the manifest's draft notes."""
    gguf = read_gguf(source)
    cfg = gguf_config(gguf)
    tensors: dict[str, torch.Tensor] = {}
    exact, requantized = [], []
    linears = gguf_linear_groups(gguf, cfg)
    total = 4 * cfg.num_layers + 1
    for name, groups, is_exact in tqdm(linears, total=total, desc="int4 draft", unit="proj", disable=not progress):
        for part, value in (("scales", groups.scales), ("mins", groups.mins)):
            half = value.half()
            if not torch.equal(half.float(), value):  # Q4_1 and our rule both keep fp16 values
                raise AssertionError(f"{name}.{part} is not fp16-exact")
            tensors[f"int4.{name}.{part}"] = half
        tensors[f"int4.{name}.codes"] = pack_nibbles(groups.codes)
        (exact if is_exact else requantized).append(name)
    for param, value in _plain_params(gguf, cfg, set(exact) | set(requantized)).items():
        tensors[f"param.{param}"] = value.contiguous()
    dest.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest), metadata={"format_version": str(FORMAT_VERSION)})
    if requantized:
        log.info("draft: %d projections re-quantized to 4 bits (not Q4_1 in the GGUF): %s", len(requantized), requantized)
    return {
        "config": cfg.to_json(),
        "projections_exact_from_q4_1": len(exact),
        "projections_requantized": requantized,
    }


# -- placing a model in the engine ----------------------------------------------------------


def _model_files(path: Path) -> list[Path]:
    """The files that make a model: the GGUF file itself, or a Hugging Face directory's config
    and safetensors (its tokenizer is saved separately, from the target)."""
    if is_gguf(path):
        return [path]
    files = [path / n for n in _HF_MODEL_FILES if (path / n).is_file()] + sorted(path.glob("*.safetensors"))
    if not any(f.suffix == ".safetensors" for f in files):
        raise FileNotFoundError(f"{path}: no *.safetensors weights (only safetensors is supported)")
    return files


def source_sha256(path: Path) -> str:
    """SHA-256 of a model: of the GGUF file, or over a directory's model files by name."""
    if is_gguf(path):
        return file_sha256(path)
    listing = {f.name: file_sha256(f) for f in _model_files(path)}
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()


def _link_or_copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def _place_model(source: Path, stage: Path, gguf_rel: str, dir_rel: str) -> str:
    """Link (or copy) a model into the staging directory; returns its path in the engine."""
    if is_gguf(source):
        _link_or_copy(source, stage / gguf_rel)
        return gguf_rel
    for f in _model_files(source):
        _link_or_copy(f, stage / dir_rel / f.name)
    return dir_rel


# -- build ------------------------------------------------------------------------------------


def _fingerprint(recipe: Recipe, target_sha: str, draft_sha: str) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "backend": recipe.backend,
        "target_sha256": target_sha,
        "draft_source_sha256": draft_sha,
        "head_top_k": recipe.head_top_k,
        "target_dtype": recipe.target_dtype,
        "draft_dtype": recipe.draft_dtype,
        "plain_weights": recipe.plain_weights,
        "speculation": dict(recipe.speculation),
        "code_sha256": _code_hashes(),
    }


def _up_to_date(engine: Path, fingerprint: dict) -> bool:
    try:
        manifest = json.loads((engine / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("build", {}).get("fingerprint") != fingerprint:
        return False
    outputs = manifest["build"].get("outputs", {})
    return bool(outputs) and all(
        (engine / rel).is_file() and file_sha256(engine / rel) == sha for rel, sha in outputs.items()
    )


def build_engine(
    name_or_ref: str | os.PathLike = DEFAULT_ENGINE,
    out_dir: str | os.PathLike | None = None,
    *,
    draft: str | os.PathLike | None = None,
    name: str | None = None,
    head_top_k: int = DEFAULT_HEAD_TOP_K,
    target_dtype: str | None = None,
    draft_dtype: str | None = None,
    plain_weights: bool | None = None,
    backend: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Build (or find up to date) the engine ``<out_dir>/<name>``; returns its path.

    name_or_ref: a named engine ("smollm2-135m", "qwen2.5-coder-1.5b": fetched into the cache on
    first use), or a .gguf file / Hugging Face directory as the target. out_dir: engines directory
    (default ``default_engines_dir()``). draft: another model as the draft (default: the named
    engine's, or the target's own weights in int4). target_dtype, draft_dtype, plain_weights: see ``Recipe``.
    force: rebuild even when up to date.
    """
    start = time.perf_counter()
    recipe = resolve_recipe(name_or_ref, draft=draft, name=name, head_top_k=head_top_k,
                            target_dtype=target_dtype, draft_dtype=draft_dtype, plain_weights=plain_weights,
                            backend=backend)
    out = Path(out_dir) if out_dir is not None else default_engines_dir()
    engine = out / recipe.name
    target_sha = source_sha256(recipe.target)
    draft_sha = target_sha if recipe.self_draft else source_sha256(recipe.draft)
    fingerprint = _fingerprint(recipe, target_sha, draft_sha)
    if not force and _up_to_date(engine, fingerprint):  # the common case; needs no write access
        log.info("engine %s is up to date", engine)
        return engine
    out.mkdir(parents=True, exist_ok=True)
    # One build per engine at a time (two ranks or test workers may ask for the default engine at
    # once); whoever waits finds the engine up to date.
    with open(out / f".{recipe.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _up_to_date(engine, fingerprint):
            log.info("engine %s was built meanwhile by another process", engine)
            return engine
        _build(recipe, engine, fingerprint, progress)
    log.info("built engine %s in %.1f s", engine, time.perf_counter() - start)
    return engine


def _build(recipe: Recipe, engine: Path, fingerprint: dict, progress: bool) -> None:
    start = time.perf_counter()
    if engine.exists() and not (engine / MANIFEST).is_file() and any(engine.iterdir()):
        raise ValueError(f"{engine} exists and is not an engine directory; choose another name or out_dir")
    target_cfg = load_config(recipe.target)
    target_tok, draft_tok = tokenizer_fields(recipe.target, recipe.draft)
    check_same_tokenizer(target_tok, draft_tok, str(recipe.target), str(recipe.draft))
    if not recipe.self_draft:
        check_same_vocab_rows(target_cfg, load_config(recipe.draft), str(recipe.target), str(recipe.draft))

    # Built in a staging directory and moved into place: a failed build leaves no half engine.
    stage = Path(tempfile.mkdtemp(dir=engine.parent, prefix=f".{recipe.name}.build-"))
    try:
        log.info("building engine %s from %s (draft: %s; %s)", recipe.name, recipe.target, recipe.draft,
                 "ggml" if recipe.backend == "ggml" else f"torch, draft {recipe.draft_dtype}")
        target = _target_entry(recipe, _place_model(recipe.target, stage, TARGET_FILE, TARGET_DIR))
        if recipe.backend == "ggml":
            draft = _ggml_entry(TARGET_FILE if recipe.self_draft else _place_model(recipe.draft, stage, DRAFT_GGUF, DRAFT_DIR))
        elif recipe.target_dtype == "int8":
            _write_int8(recipe.target, stage / TARGET_INT8, "target", progress)
        if recipe.backend == "ggml":
            pass
        elif recipe.draft_dtype == "int4":
            draft = _int4_draft_entry(recipe, _write_draft(recipe.draft, stage / DRAFT_FILE, progress))
        elif recipe.draft_dtype == "int8":
            draft = _int8_draft_entry(recipe, _place_model(recipe.draft, stage, DRAFT_GGUF, DRAFT_DIR))
            _write_int8(recipe.draft, stage / DRAFT_INT8, "draft", progress)
        else:
            draft = _torch_draft_entry(recipe, _place_model(recipe.draft, stage, DRAFT_GGUF, DRAFT_DIR))
        tokenizer = _save_tokenizer(recipe.target, target_tok, stage)
        manifest = _manifest(recipe, fingerprint, target_cfg, target, draft, tokenizer, stage)
        manifest["build"]["seconds"] = round(time.perf_counter() - start, 2)
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _make_readable(stage)
        if engine.exists():
            shutil.rmtree(engine)
        os.replace(stage, engine)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if recipe.backend == "torch" and recipe.draft_dtype in ("int4", "int8"):
        _prepare_compiled_layers()


def _prepare_compiled_layers() -> None:
    """Compile the draft's fused layers now (cached per machine by torch), so the first draft rank
    does not spend its start-up on it; a failure only means the draft will use the torch layers."""
    try:
        load_extension()
    except Exception as err:  # noqa: BLE001 - reported again, with the reason, when a draft loads
        log.warning("could not compile the draft's fused int4 layers (the torch layers will be used): %s", err)


def _make_readable(root: Path) -> None:
    """mkdtemp and some writers create owner-only modes; an engine is shared read-only data."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _save_tokenizer(source: Path, fields: Mapping[str, Any], stage: Path) -> dict | None:
    """Save the target's Hugging Face tokenizer (rebuilt from GGUF metadata, chat template
    included, or read from its directory); None when the model has none."""
    if not fields or (is_gguf(source) and "tokenizer.ggml.tokens" not in fields):
        return None
    tok = load_tokenizer(source)
    tok.save_pretrained(str(stage / TOKENIZER_DIR))
    gguf_fields = is_gguf(source)
    return {
        "path": TOKENIZER_DIR,
        "source": "target GGUF metadata" if gguf_fields else "target Hugging Face directory",
        "vocab_size": len(fields["tokenizer.ggml.tokens"] if gguf_fields else fields["vocab"]),
        "num_merges": len(fields.get("tokenizer.ggml.merges" if gguf_fields else "merges", [])),
        "chat_template": bool(getattr(tok, "chat_template", None)),
        "fields_sha256": tokenizer_sha256(fields),
        "draft_checked_identical": True,
    }


def _torch_side(path: str, dtype: str, plain_weights: bool) -> dict:
    """Manifest entry of a model that the torch backend runs from its own (dequantized) weights."""
    gguf_file = path.endswith(".gguf")
    fp32_linears = (
        "oneDNN-packed, plus the plain weights for single rows (MKL GEMV)" if plain_weights
        else "oneDNN-packed only (single rows too; half the memory)"
    )
    return {
        "backend": "torch",
        "path": path,
        "format": "gguf" if gguf_file else "huggingface",
        "dtype": dtype,
        "plain_weights": plain_weights,
        "weights": (f"GGUF blocks dequantized to fp32 at load time, run in {dtype}" if gguf_file
                    else f"safetensors weights run in {dtype}"),
        "linears": fp32_linears if dtype == "float32" else "oneDNN-packed",
    }


def _write_int8(source: Path, dest: Path, side: str, progress: bool) -> None:
    """The int8 weights of a side (trtssd.models.int8_dynamic.int8_checkpoint) from its fp32 ones."""
    cfg, state = load_state_dict(source)
    bar = lambda names: tqdm(names, desc=f"int8 {side}", unit="proj", disable=not progress)  # noqa: E731
    tensors = int8_checkpoint(cfg, state, bar)
    del state
    dest.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest), metadata={"format_version": str(FORMAT_VERSION)})


def _ggml_entry(path: str) -> dict:
    """Manifest entry of a side that llama.cpp runs from its GGUF file as it is."""
    return {
        "backend": "ggml",
        "path": path,
        "format": "gguf",
        "weights": "the GGUF file's own tensor types, memory-mapped by llama.cpp (nothing converted)",
        "execution": "llama.cpp through llama-cpp-python (trtssd/backends/ggml_backend.py): flash attention, "
                     "no weight repacking, one sequence id per tree branch",
    }


def _target_entry(recipe: Recipe, path: str) -> dict:
    if recipe.backend == "ggml":
        return _ggml_entry(path)
    if recipe.target_dtype == "int8":
        return _int8_entry(_torch_side(path, TORCH_DTYPES[0], recipe.plain_weights), TARGET_INT8_LEVELS, TARGET_INT8)
    return _torch_side(path, recipe.target_dtype, recipe.plain_weights)


def _int8_entry(fp32_entry: dict, levels: int, weights_file: str) -> dict:
    """A side run with int8 projections from ``weights_file``; its model placed as is stays the
    source (and what a CUDA device runs, in fp32)."""
    return {
        **{key: value for key, value in fp32_entry.items() if key != "linears"},  # no fp32 projections
        "backend": "torch-int8",
        "dtype": "float32 activations, KV, norms and attention; int8 inside the projections",
        "int8_weights": weights_file,
        "weights": f"{weights_file}: int8 projections and the fp32 rest, made at build time from the model's "
                   "weights and packed for fbgemm at load time",
        "projections": f"int8 per output channel; activations quantized per row at each forward in {levels} "
                       "level(s) of 7 bits (fbgemm dynamic linear; trtssd/models/int8_dynamic.py)",
        "activation_levels": levels,
        "lm_head": "int8, like the projections",
    }


def _torch_draft_entry(recipe: Recipe, path: str) -> dict:
    return {
        **_torch_side(path, recipe.draft_dtype, recipe.plain_weights),
        "config": load_config(recipe.draft).to_json(),
        "execution": "torch layers (the compiled int4 layers are for the int4 self-draft only)",
    }


def _int8_draft_entry(recipe: Recipe, path: str) -> dict:
    return {
        **_int8_entry(_torch_draft_entry(recipe, path), DRAFT_INT8_LEVELS, DRAFT_INT8),
        "execution": f"forwards of up to {FUSED_MAX_TOKENS} tokens: compiled layers "
                     "(trtssd/kernels/draft_layers.cpp, built on first load); wider ones: torch layers",
    }


def _int4_draft_entry(recipe: Recipe, notes: dict) -> dict:
    return {
        "backend": "torch-int4",
        "path": DRAFT_FILE,
        "format": "safetensors",
        "dtype": "float32 activations, KV, norms and attention; bfloat16 inside int4 projections",
        "projections": "int4 weight-only, 32-wide groups with scale and zero, aten._weight_int4pack_mm_for_cpu",
        "lm_head": f"int4, top-{recipe.head_top_k} rows re-scored in fp32",
        "execution": f"forwards of up to {FUSED_MAX_TOKENS} tokens: compiled layers "
                     "(trtssd/kernels/draft_layers.cpp, built on first load); wider ones: torch layers",
        "head_top_k": recipe.head_top_k,
        **notes,
    }


def _manifest(recipe: Recipe, fingerprint: dict, target_cfg: ModelConfig, target: dict, draft: dict,
              tokenizer: dict | None, stage: Path) -> dict:
    outputs = sorted(str(p.relative_to(stage)) for side in (TARGET_DIR, DRAFT_DIR) for p in (stage / side).rglob("*")
                     if p.is_file())
    return {
        "format_version": FORMAT_VERSION,
        "name": recipe.name,
        "architecture": target_cfg.to_json(),
        "tokenizer": tokenizer,
        "target": target,
        "draft": draft,
        "speculation": dict(recipe.speculation),
        "build": {
            "recipe": {"name": recipe.name, "backend": recipe.backend, "target": str(recipe.target),
                       "draft": str(recipe.draft),
                       "target_dtype": recipe.target_dtype, "draft_dtype": recipe.draft_dtype},
            "fingerprint": fingerprint,
            "outputs": {rel: file_sha256(stage / rel) for rel in outputs},
            "versions": {"trtssd": version("trtssd"), "torch": torch.__version__, "gguf": version("gguf")},
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
