"""TensorRT-LLM 1.2.x engines for a trtssd engine: the command lines, a script, and running it.

``trtssd build --backend trtllm [NAME]`` writes ``<engines>/<NAME>.trtllm/build.sh`` next to the
torch engine directory ``<engines>/<NAME>/`` and runs it when ``tensorrt_llm`` is importable. Per
side (target, draft) the script does three steps:

1. GGUF -> Hugging Face checkpoint. Our engines keep GGUF files; TensorRT-LLM's converters read
   Hugging Face directories, so transformers dequantizes the GGUF blocks and saves safetensors.
2. Hugging Face -> TensorRT-LLM checkpoint, with the model family's ``convert_checkpoint.py``
   from TensorRT-LLM's examples (release/1.2: ``examples/models/core/{llama,qwen}/``;
   arguments ``--model_dir --output_dir --dtype [--use_weight_only --weight_only_precision int4]``).
3. ``trtllm-build`` (``tensorrt_llm/commands/build.py``). The target gets
   ``--speculative_decoding_mode draft_tokens_external --max_draft_len K`` so each verification
   request may carry K external draft tokens; both sides get the paged KV cache and paged context
   FMHA, which KV block reuse needs (every DTM verification is a new request carrying the whole
   prefix, and block reuse is what keeps that prefix from being recomputed; reuse itself is
   switched on at run time by ``KvCacheConfig(enable_block_reuse=True)``).

The tree-attention plugin in ``plugins/`` does not apply: a ``draft_tokens_external`` target
verifies one linear chain per request, and TensorRT-LLM builds such engines without the
spec-decoding mask inputs (``tensorrt_llm/models/generation_mixin.py``); the SSD draft rank, which
decodes trees, stays on torch.

Only the command lines are ours, and they are plain data built without TensorRT-LLM or weights:
the architecture family comes from the engine's manifest, or from the catalog for a named engine
that is not built yet.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from trtssd.build import build_engine, default_engines_dir
from trtssd.config import RuntimeConfig, SpeculativeConfig
from trtssd.models.catalog import NAMED_ENGINES
from trtssd.models.engine_dir import DRAFT_GGUF, MANIFEST, TARGET_FILE, TOKENIZER_DIR
from trtssd.trtllm.availability import CONTAINER, RELEASE, missing_message, tensorrt_llm_available

log = logging.getLogger(__name__)

SCRIPT_NAME = "build.sh"
SUFFIX = ".trtllm"  # <engines>/<name>.trtllm sits next to the torch engine <engines>/<name>
# Where convert_checkpoint.py lives: TensorRT-LLM's examples/, not part of its wheel. The default
# is the examples directory of the TensorRT-LLM release containers; the script reads
# TRTLLM_EXAMPLES when it runs, so any release/1.2 checkout can be used instead.
DEFAULT_EXAMPLES = "/app/tensorrt_llm/examples"
# convert_checkpoint.py per architecture family (release/1.2 layout of examples/).
CONVERTERS = {
    "llama": "models/core/llama/convert_checkpoint.py",
    "qwen2": "models/core/qwen/convert_checkpoint.py",
}


@dataclass(frozen=True)
class EngineLimits:
    """Shapes the engines are built for; the defaults follow trtssd's own (trtssd/config.py)."""

    max_batch_size: int = RuntimeConfig.max_batch  # sequences in flight (the dataclass default)
    max_seq_len: int = RuntimeConfig.max_seq_len  # prompt + output tokens per sequence
    # TensorRT-LLM dtype of weights and activations: its kernels run fp16/bf16, not our CPU fp32.
    dtype: str = "bfloat16"

    @property
    def max_input_len(self) -> int:
        # Every verification re-submits the whole sequence so far as a new request's input.
        return self.max_seq_len - 1


@dataclass(frozen=True)
class Side:
    """One model (target or draft) and the directories of its three steps."""

    role: str  # "target" or "draft"
    family: str  # key of CONVERTERS
    source_dir: Path  # the torch engine's directory holding the GGUF
    gguf_name: str  # the GGUF's file name in source_dir
    hf_dir: Path  # step 1 output
    checkpoint_dir: Path  # step 2 output
    engine_dir: Path  # step 3 output
    int4_weight_only: bool = False  # the int4 self-draft: the target's weights, int4 weight-only
    export: bool = True  # False: reuses another side's Hugging Face directory (self-draft)


@dataclass(frozen=True)
class TrtllmPlan:
    name: str
    engine: Path  # the torch engine directory (GGUF files, tokenizer, manifest)
    root: Path  # <engines>/<name>.trtllm
    k: int  # --max_draft_len of the target
    limits: EngineLimits
    target: Side
    draft: Side

    @property
    def script(self) -> Path:
        return self.root / SCRIPT_NAME


@dataclass(frozen=True)
class TrtllmBuild:
    """What ``build_trtllm`` did: the script is always written; ``ran`` says whether it ran."""

    script: Path
    ran: bool
    message: str


# -- the plan: which models, which family, which directories ----------------------------------


def _family_and_self_draft(name: str, engine: Path) -> tuple[str, bool]:
    """(architecture family, whether the draft is the target's own weights): from the engine's
    manifest when it is built, else from the catalog entry of a named engine."""
    manifest = engine / MANIFEST
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        if data["target"].get("format") != "gguf":
            raise ValueError(f"{engine}: only engines built from GGUF files have TensorRT-LLM build commands here")
        return data["architecture"]["arch"], data["draft"].get("backend") == "torch-int4"
    named = NAMED_ENGINES.get(name)
    if named is None:
        known = ", ".join(map(repr, NAMED_ENGINES))
        raise ValueError(f"engine {name!r} is neither built ({manifest} is missing) nor a named engine ({known})")
    return named.family, named.draft is None


def plan_for(name: str, engines_dir: str | Path | None = None, *, k: int | None = None,
             limits: EngineLimits = EngineLimits()) -> TrtllmPlan:
    """The TensorRT-LLM build of engine ``name`` under ``engines_dir`` (default: trtssd's);
    ``k`` (the target's --max_draft_len) defaults to the named engine's tuned lookahead, else
    trtssd's default."""
    if k is None:
        named = NAMED_ENGINES.get(name)
        k = named.speculation.get("torch", {}).get("k", SpeculativeConfig.k) if named is not None else SpeculativeConfig.k
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (--max_draft_len) must be an int >= 1, got {k!r}")
    engines = Path(engines_dir) if engines_dir is not None else default_engines_dir()
    engine = (engines / name).resolve()
    family, self_draft = _family_and_self_draft(name, engine)
    if family not in CONVERTERS:
        raise ValueError(f"architecture {family!r} has no TensorRT-LLM converter here; known: {sorted(CONVERTERS)}")
    root = engine.parent / f"{engine.name}{SUFFIX}"
    target = _side("target", family, engine, TARGET_FILE, root)
    if self_draft:  # the target's own weights, int4 weight-only (as the torch int4 self-draft)
        draft = Side("draft", family, target.source_dir, target.gguf_name, target.hf_dir,
                     root / "checkpoint" / "draft", root / "draft", int4_weight_only=True, export=False)
    else:
        draft = _side("draft", family, engine, DRAFT_GGUF, root)
    return TrtllmPlan(engine.name, engine, root, k, limits, target, draft)


def _side(role: str, family: str, engine: Path, gguf_rel: str, root: Path) -> Side:
    gguf = engine / gguf_rel
    return Side(role, family, gguf.parent, gguf.name, root / "hf" / role, root / "checkpoint" / role, root / role)


# -- the command lines -------------------------------------------------------------------------

# Step 1 as a here-document for python3: transformers reads the GGUF (gguf_file=) and saves a
# Hugging Face directory, with the engine's tokenizer next to it. Arguments: source directory,
# GGUF file name, tokenizer directory, output directory.
EXPORT_HF = """\
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
source, gguf, tokenizer, out = sys.argv[1:5]
AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, torch_dtype="float32").save_pretrained(out)
AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
"""


def export_command(side: Side, tokenizer_dir: Path) -> list[str]:
    """Step 1 (its program, EXPORT_HF, goes on stdin)."""
    return ["python3", "-", str(side.source_dir), side.gguf_name, str(tokenizer_dir), str(side.hf_dir)]


def convert_command(side: Side, limits: EngineLimits, examples: str = "$TRTLLM_EXAMPLES") -> list[str]:
    """Step 2: the family's convert_checkpoint.py."""
    command = ["python3", f"{examples}/{CONVERTERS[side.family]}", "--model_dir", str(side.hf_dir),
               "--output_dir", str(side.checkpoint_dir), "--dtype", limits.dtype]
    if side.int4_weight_only:
        command += ["--use_weight_only", "--weight_only_precision", "int4"]
    return command


def build_command(side: Side, limits: EngineLimits, k: int) -> list[str]:
    """Step 3: trtllm-build."""
    command = ["trtllm-build", "--checkpoint_dir", str(side.checkpoint_dir), "--output_dir", str(side.engine_dir),
               "--max_batch_size", str(limits.max_batch_size), "--max_input_len", str(limits.max_input_len),
               "--max_seq_len", str(limits.max_seq_len), "--gemm_plugin", "auto",
               "--kv_cache_type", "paged", "--use_paged_context_fmha", "enable"]
    if side.role == "target":
        # K external draft tokens per verification request. float32 logits: TensorRT-LLM's
        # acceptance recomputes q' by a softmax of the draft logits we send, in the logits' dtype;
        # in fp16 that q' would drift from the one the draft sampled from.
        command += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(k),
                    "--logits_dtype", "float32"]
    else:
        # Its generation logits are the draft logits when this engine drafts for a DTM baseline.
        command += ["--gather_generation_logits"]
    return command


def render_script(plan: TrtllmPlan) -> str:
    """The whole build as a bash script (re-runnable; each step overwrites its output)."""
    lines = [
        "#!/usr/bin/env bash",
        f"# TensorRT-LLM {RELEASE} engines for the trtssd engine {plan.name!r}, written by",
        "# `trtssd build --backend trtllm`. unverified: never run (docs/tensorrt_llm.md).",
        f"# Run it where TensorRT-LLM {RELEASE} is installed, e.g. in {CONTAINER};",
        "# TRTLLM_EXAMPLES: TensorRT-LLM's examples/ directory (release/1.2) holding convert_checkpoint.py.",
        "set -euo pipefail",
        f'TRTLLM_EXAMPLES="${{TRTLLM_EXAMPLES:-{DEFAULT_EXAMPLES}}}"',
    ]
    tokenizer = plan.engine / TOKENIZER_DIR
    for side in (plan.target, plan.draft):
        lines.append("")
        if side.export:
            lines.append(f"# {side.role}: GGUF -> Hugging Face checkpoint")
            lines += [_shell(export_command(side, tokenizer)) + " <<'EOF'", EXPORT_HF.rstrip("\n"), "EOF"]
        lines.append(f"# {side.role}: Hugging Face -> TensorRT-LLM checkpoint")
        lines.append(_shell(convert_command(side, plan.limits)))
        lines.append(f"# {side.role}: engine")
        lines.append(_shell(build_command(side, plan.limits, plan.k)))
    return "\n".join(lines) + "\n"


def _shell(command: list[str]) -> str:
    """A command line; "$TRTLLM_EXAMPLES/..." stays expandable (inside double quotes)."""
    return " ".join(f'"{word}"' if word.startswith("$") else shlex.quote(word) for word in command)


# -- writing and running -----------------------------------------------------------------------


def write_script(plan: TrtllmPlan) -> Path:
    plan.root.mkdir(parents=True, exist_ok=True)
    plan.script.write_text(render_script(plan))
    plan.script.chmod(0o755)
    return plan.script


def build_trtllm(name: str, engines_dir: str | Path | None = None, *, k: int | None = None,
                 limits: EngineLimits = EngineLimits()) -> TrtllmBuild:
    """Write the TensorRT-LLM build script of engine ``name`` and run it when ``tensorrt_llm`` is
    importable (building the torch engine first: the script reads its GGUF files). Without it,
    nothing is fetched or built, and the message says what is missing and where the script is.
    Running the script is unverified: never run."""
    plan = plan_for(name, engines_dir, k=k, limits=limits)
    script = write_script(plan)
    if not tensorrt_llm_available():
        message = (missing_message("Building TensorRT-LLM engines") + f" The commands were written to {script}; "
                   f"run `bash {script}` there (set TRTLLM_EXAMPLES to TensorRT-LLM's examples/ directory).")
        log.warning("%s", message)
        return TrtllmBuild(script, False, message)
    if not (plan.engine / MANIFEST).is_file():  # a named engine not built yet
        build_engine(plan.name, plan.engine.parent)
    log.info("running %s", script)
    subprocess.run(["bash", str(script)], check=True)
    return TrtllmBuild(script, True, f"TensorRT-LLM engines built in {plan.target.engine_dir} and {plan.draft.engine_dir}")
