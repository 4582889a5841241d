"""Building engine directories: a target and a draft model, prepared once, loaded fast by each rank
(reading them back is ``trtssd.models.engine_dir`` and ``trtssd.backends.loading``).

``build_engine`` turns a model reference (a registered name such as the default "smollm2-135m",
or a path to a GGUF file) into ``<out_dir>/<name>/``::

    manifest.json           what was built, from what, how (format below)
    target/model.gguf       the target's GGUF, as given (hard link or copy); the torch backend
                            dequantizes it to fp32 at load time
    draft/model.safetensors the quantized self-draft: 4-bit groups of every projection
                            (``int4.<linear>.codes|scales|mins``) and the remaining fp32
                            parameters (``param.<name>``: embedding, norms, biases)
    tokenizer/              the Hugging Face tokenizer rebuilt from the target's GGUF metadata

The draft is the target's own Q4_1 weights run by torch's int4 kernel (trtssd.models.quant);
see docs/draft.md for why. Building is idempotent: when manifest.json records the same inputs
(source hashes, options, format and build-code hashes) and the outputs still hash as recorded,
nothing is done. The target and draft tokenizers must be identical (vocabulary, token types,
merges, special tokens), else ``TokenizerMismatchError``.
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
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from trtssd.config import ModelRef
from trtssd.hashing import file_sha256
from trtssd.kernels.int4_draft import DEFAULT_MAX_TOKENS as FUSED_MAX_TOKENS
from trtssd.kernels.int4_draft import load_extension
from trtssd.models.config import ModelConfig
from trtssd.models.engine_dir import DRAFT_FILE, is_engine_dir, FORMAT_VERSION, MANIFEST, TARGET_FILE, TOKENIZER_DIR
from trtssd.models.loader import GGUFTensor, gguf_config, gguf_sources, load_config, read_gguf, unpermute_rows
from trtssd.models.quant import gguf_linear_groups, pack_nibbles
from trtssd.models.smollm2 import ensure_smollm2_gguf
from trtssd.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_ENGINE = "smollm2-135m"  # the embedded default: SmolLM2-135M-Instruct, Q4_1 GGUF
DEFAULT_HEAD_TOP_K = 16  # draft logits re-scored exactly in fp32 (docs/draft.md: agreement 0.90 -> ~1.0)
# Code whose change alters what a build produces: its hash is part of the no-op check.
_BUILD_CODE = ("build.py", "models/quant.py", "models/loader.py", "models/config.py")
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


class TokenizerMismatchError(ValueError):
    """Target and draft do not tokenize identically, so draft tokens would mean other text."""


@dataclass(frozen=True)
class Recipe:
    """What an engine is built from."""

    name: str  # engine directory name under out_dir
    target: Path  # GGUF file of the target model
    draft: Path  # GGUF file whose weights become the int4 draft (the target itself: self-draft)
    head_top_k: int = DEFAULT_HEAD_TOP_K  # draft output rows re-scored in fp32 (0 = none)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"engine name must be a plain directory name, got {self.name!r}")
        if not isinstance(self.head_top_k, int) or self.head_top_k < 0:
            raise ValueError(f"head_top_k must be a non-negative int, got {self.head_top_k!r}")


# -- references ------------------------------------------------------------------------------


REGISTERED = (DEFAULT_ENGINE,)  # engine names that resolve to a model fetched on demand


def _registered_source(name: str) -> Path:
    return {DEFAULT_ENGINE: ensure_smollm2_gguf}[name]()


def resolve_recipe(
    name_or_ref: str | os.PathLike = DEFAULT_ENGINE,
    *,
    draft: str | os.PathLike | None = None,
    name: str | None = None,
    head_top_k: int = DEFAULT_HEAD_TOP_K,
) -> Recipe:
    """A registered engine name or a GGUF path → Recipe. ``draft``: another GGUF to quantize as
    the draft instead of the target itself. ``name``: engine directory name (default: the
    registered name or the GGUF file's stem, lower-cased)."""
    ref = str(name_or_ref)
    if ref in REGISTERED:
        target = _registered_source(ref)
        default_name = ref
    elif ref.endswith(".gguf"):
        target = Path(ref).expanduser().resolve()
        if not target.is_file():
            raise FileNotFoundError(f"GGUF file not found: {target}")
        default_name = target.stem.lower()
    elif Path(ref).is_dir():
        raise ValueError(f"{ref}: building from a Hugging Face directory is not supported; give a .gguf file or {DEFAULT_ENGINE!r}")
    else:
        raise ValueError(f"unknown engine name {ref!r}; known: {', '.join(map(repr, REGISTERED))}, or give a path to a .gguf file")
    draft_path = target if draft is None else Path(draft).expanduser().resolve()
    if draft is not None and (draft_path.suffix != ".gguf" or not draft_path.is_file()):
        raise FileNotFoundError(f"draft must be an existing .gguf file, got {draft_path}")
    return Recipe(name or default_name, target, draft_path, head_top_k)


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


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"first difference at index {i}: {x!r} vs {y!r}"
        return f"lengths {len(a)} vs {len(b)}"
    return f"{a!r} vs {b!r}"


def check_same_tokenizer(target: Mapping[str, Any], draft: Mapping[str, Any], target_name: str, draft_name: str) -> None:
    """Raise TokenizerMismatchError naming the first field that differs."""
    for key in _TOKENIZER_KEYS:
        a, b = target.get(key), draft.get(key)
        if a != b:
            raise TokenizerMismatchError(
                f"tokenizers of target {target_name} and draft {draft_name} differ in {key}: "
                f"{_first_difference(a, b)}. A draft must use exactly the target's tokenizer."
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


# -- build ------------------------------------------------------------------------------------


def _fingerprint(recipe: Recipe, target_sha: str, draft_sha: str) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "target_sha256": target_sha,
        "draft_source_sha256": draft_sha,
        "head_top_k": recipe.head_top_k,
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


def _link_or_copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def build_engine(
    name_or_ref: str | os.PathLike = DEFAULT_ENGINE,
    out_dir: str | os.PathLike | None = None,
    *,
    draft: str | os.PathLike | None = None,
    name: str | None = None,
    head_top_k: int = DEFAULT_HEAD_TOP_K,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Build (or find up to date) the engine ``<out_dir>/<name>``; returns its path.

    name_or_ref: "smollm2-135m" (fetched into the cache on first use) or a .gguf path.
    out_dir: engines directory (default ``default_engines_dir()``). draft: a different GGUF to
    quantize as the draft (default: the target itself). force: rebuild even when up to date.
    """
    start = time.perf_counter()
    recipe = resolve_recipe(name_or_ref, draft=draft, name=name, head_top_k=head_top_k)
    out = Path(out_dir) if out_dir is not None else default_engines_dir()
    engine = out / recipe.name
    target_sha = file_sha256(recipe.target)
    draft_sha = target_sha if recipe.draft == recipe.target else file_sha256(recipe.draft)
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
    target_tok = gguf_tokenizer_fields(recipe.target)
    draft_tok = target_tok if recipe.draft == recipe.target else gguf_tokenizer_fields(recipe.draft)
    check_same_tokenizer(target_tok, draft_tok, str(recipe.target), str(recipe.draft))

    # Built in a staging directory and moved into place: a failed build leaves no half engine.
    stage = Path(tempfile.mkdtemp(dir=engine.parent, prefix=f".{recipe.name}.build-"))
    try:
        log.info("building engine %s from %s (draft from %s)", recipe.name, recipe.target, recipe.draft)
        _link_or_copy(recipe.target, stage / TARGET_FILE)
        draft_notes = _write_draft(recipe.draft, stage / DRAFT_FILE, progress)
        tokenizer = _save_tokenizer(recipe.target, target_tok, stage)
        manifest = _manifest(recipe, fingerprint, draft_notes, tokenizer, stage)
        manifest["build"]["seconds"] = round(time.perf_counter() - start, 2)
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _make_readable(stage)
        if engine.exists():
            shutil.rmtree(engine)
        os.replace(stage, engine)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
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
    """Save the Hugging Face tokenizer rebuilt from the GGUF (None when the GGUF has none)."""
    if "tokenizer.ggml.tokens" not in fields:
        return None
    load_tokenizer(source).save_pretrained(str(stage / TOKENIZER_DIR))
    return {
        "path": TOKENIZER_DIR,
        "source": "target GGUF metadata",
        "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        "num_merges": len(fields.get("tokenizer.ggml.merges", [])),
        "fields_sha256": tokenizer_sha256(fields),
        "draft_checked_identical": True,
    }


def _manifest(recipe: Recipe, fingerprint: dict, draft_notes: dict, tokenizer: dict | None, stage: Path) -> dict:
    cfg = draft_notes.pop("config")
    target_cfg = load_config(recipe.target)
    return {
        "format_version": FORMAT_VERSION,
        "name": recipe.name,
        "architecture": target_cfg.to_json(),
        "tokenizer": tokenizer,
        "target": {
            "backend": "torch",
            "path": TARGET_FILE,
            "format": "gguf",
            "dtype": "float32",
            "weights": "GGUF blocks dequantized to fp32 at load time",
        },
        "draft": {
            "backend": "torch-int4",
            "path": DRAFT_FILE,
            "format": "safetensors",
            "dtype": "float32 activations, KV, norms and attention; bfloat16 inside int4 projections",
            "projections": "int4 weight-only, 32-wide groups with scale and zero, aten._weight_int4pack_mm_for_cpu",
            "lm_head": f"int4, top-{recipe.head_top_k} rows re-scored in fp32",
            "execution": f"forwards of up to {FUSED_MAX_TOKENS} tokens: compiled layers "
                         "(trtssd/kernels/int4_draft.cpp, built on first load); wider ones: torch layers",
            "head_top_k": recipe.head_top_k,
            "config": cfg,
            **draft_notes,
        },
        "build": {
            "recipe": {"name": recipe.name, "target": str(recipe.target), "draft": str(recipe.draft)},
            "fingerprint": fingerprint,
            "outputs": {rel: file_sha256(stage / rel) for rel in (TARGET_FILE, DRAFT_FILE)},
            "versions": {"trtssd": version("trtssd"), "torch": torch.__version__, "gguf": version("gguf")},
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }


def resolve_models(engine: str | None, target: ModelRef | None, draft: ModelRef | None) -> tuple[ModelRef, ModelRef]:
    """The (target, draft) pair to load: explicit refs, an engine directory, or the default."""
    if target is not None:
        if engine is not None:
            raise ValueError("give either engine or target/draft, not both")
        return target, draft if draft is not None else target
    if draft is not None:
        raise ValueError("a draft ModelRef needs a target ModelRef too")
    if engine is None:
        engine = str(default_engine())
    if not is_engine_dir(engine):
        raise ValueError(f"engine {engine!r} is not an engine directory (no manifest.json); build one with `trtssd build`")
    return ModelRef(engine, "target"), ModelRef(engine, "draft")
