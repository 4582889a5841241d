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

Tensor parallelism (``tp_size`` T > 1, the target only): the converter splits the checkpoint
(``--tp_size T``: one weight shard per rank, and a ``mapping`` with ``tp_size`` and
``world_size`` T in its config.json), and ``trtllm-build`` takes the world size
from that mapping and writes ``rank0.engine`` .. ``rank<T-1>.engine`` plus a config.json carrying
the same mapping (``tensorrt_llm/commands/build.py`` ``parallel_build``,
``tensorrt_llm/builder.py`` ``Engine.save``). That config.json is what the target executor reads
to choose its parallel mode (``executor_target.read_engine_parallelism``); the build's own
manifest (``trtllm.json``) records T before the script has run.

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
BUILD_MANIFEST = "trtllm.json"  # what the script builds: each side's engine directory and tp_size
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
    max_seq_len: int = RuntimeConfig.max_model_len  # prompt + output tokens per sequence (trtllm-build's name)
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
    tp_size: int = 1  # engine ranks (tensor parallelism); the draft always has one


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

    @property
    def manifest(self) -> Path:
        return self.root / BUILD_MANIFEST

    @property
    def tp_size(self) -> int:
        return self.target.tp_size


@dataclass(frozen=True)
class TrtllmBuild:
    """What ``build_trtllm`` did: the script and manifest are always written; ``ran`` says whether
    the script ran."""

    script: Path
    ran: bool
    message: str
    tp_size: int = 1  # the target engine's ranks


@dataclass(frozen=True)
class Heads:
    """The target's attention heads: what a tensor-parallel split must divide."""

    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads


@dataclass(frozen=True)
class EngineFacts:
    """What the plan needs to know about a trtssd engine, built or named."""

    family: str  # key of CONVERTERS
    self_draft: bool  # the draft is the target's own weights (int4)
    heads: Heads | None  # None: not known until the engine is built (a named engine)


# -- the plan: which models, which family, which directories ----------------------------------


def _engine_facts(name: str, engine: Path) -> EngineFacts:
    """Family, self-draft and heads from the engine's manifest when it is built, else family and
    self-draft from the catalog entry of a named engine (its heads are not known yet)."""
    manifest = engine / MANIFEST
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        if data["target"].get("format") != "gguf":
            raise ValueError(f"{engine}: only engines built from GGUF files have TensorRT-LLM build commands here")
        arch = data["architecture"]
        heads = Heads(arch["num_heads"], arch["num_kv_heads"]) if "num_heads" in arch else None
        return EngineFacts(arch["arch"], data["draft"].get("backend") == "torch-int4", heads)
    named = NAMED_ENGINES.get(name)
    if named is None:
        known = ", ".join(map(repr, NAMED_ENGINES))
        raise ValueError(f"engine {name!r} is neither built ({manifest} is missing) nor a named engine ({known})")
    return EngineFacts(named.family, named.draft is None, None)


def allowed_tp_sizes(heads: Heads) -> list[int]:
    """Tensor-parallel sizes that give every rank whole query heads and whole KV heads."""
    return [t for t in range(1, heads.num_kv_heads + 1) if heads.num_heads % t == 0 and heads.num_kv_heads % t == 0]


def check_tp_size(tp_size: object, heads: Heads | None) -> int:
    """``tp_size`` if it can split the target: a positive int, dividing its attention heads and
    KV heads when they are known (a named engine not built yet is checked once it is built)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size (the target engine's tensor-parallel ranks) must be an int >= 1; got {tp_size!r}")
    if heads is not None:
        allowed = allowed_tp_sizes(heads)
        if tp_size not in allowed:
            raise ValueError(f"tp_size={tp_size} does not divide the target's attention heads (num_attention_heads="
                             f"{heads.num_heads}, num_key_value_heads={heads.num_kv_heads}); allowed values: "
                             f"{', '.join(map(str, allowed))}")
    return tp_size


def plan_for(name: str, engines_dir: str | Path | None = None, *, k: int | None = None,
             limits: EngineLimits = EngineLimits(), tp_size: int = 1) -> TrtllmPlan:
    """The TensorRT-LLM build of engine ``name`` under ``engines_dir`` (default: trtssd's);
    ``k`` (the target's --max_draft_len) defaults to the named engine's tuned lookahead, else
    trtssd's default; ``tp_size``: the target engine's tensor-parallel ranks."""
    if k is None:
        named = NAMED_ENGINES.get(name)
        k = named.speculation.get("torch", {}).get("k", SpeculativeConfig.k) if named is not None else SpeculativeConfig.k
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (--max_draft_len) must be an int >= 1, got {k!r}")
    engines = Path(engines_dir) if engines_dir is not None else default_engines_dir()
    engine = (engines / name).resolve()
    facts = _engine_facts(name, engine)
    family, self_draft = facts.family, facts.self_draft
    if family not in CONVERTERS:
        raise ValueError(f"architecture {family!r} has no TensorRT-LLM converter here; known: {sorted(CONVERTERS)}")
    tp_size = check_tp_size(tp_size, facts.heads)
    root = engine.parent / f"{engine.name}{SUFFIX}"
    target = _side("target", family, engine, TARGET_FILE, root, tp_size)
    if self_draft:  # the target's own weights, int4 weight-only (as the torch int4 self-draft)
        draft = Side("draft", family, target.source_dir, target.gguf_name, target.hf_dir,
                     root / "checkpoint" / "draft", root / "draft", int4_weight_only=True, export=False)
    else:
        draft = _side("draft", family, engine, DRAFT_GGUF, root)
    return TrtllmPlan(engine.name, engine, root, k, limits, target, draft)


def _side(role: str, family: str, engine: Path, gguf_rel: str, root: Path, tp_size: int = 1) -> Side:
    gguf = engine / gguf_rel
    return Side(role, family, gguf.parent, gguf.name, root / "hf" / role, root / "checkpoint" / role, root / role,
                tp_size=tp_size)


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
    if side.tp_size > 1:
        # One checkpoint shard per rank, and the mapping (tp_size, world_size) trtllm-build reads.
        # Its --workers stays 1: converting the ranks one after another keeps one copy of the
        # model in memory instead of one per thread.
        command += ["--tp_size", str(side.tp_size)]
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
    if side.tp_size > 1:
        # trtllm-build has no tp flag: the ranks come from the checkpoint's mapping. --workers
        # builds them in parallel, rank r on GPU r (it caps the count at the GPUs it sees).
        command += ["--workers", str(side.tp_size)]
    return command


def render_script(plan: TrtllmPlan) -> str:
    """The whole build as a bash script (re-runnable; each step overwrites its output)."""
    lines = [
        "#!/usr/bin/env bash",
        f"# TensorRT-LLM {RELEASE} engines for the trtssd engine {plan.name!r}, written by",
        "# `trtssd build --backend trtllm`. unverified: never run (docs/tensorrt_llm.md).",
        f"# Run it where TensorRT-LLM {RELEASE} is installed, e.g. in {CONTAINER};",
        "# TRTLLM_EXAMPLES: TensorRT-LLM's examples/ directory (release/1.2) holding convert_checkpoint.py.",
        f"# target: tp_size {plan.tp_size} (rank0.engine..rank{plan.tp_size - 1}.engine; run it with "
        f"tensor_parallel_size {plan.tp_size}); draft: tp_size 1.",
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


def manifest_data(plan: TrtllmPlan) -> dict:
    """The build's manifest: per side, the engine directory trtllm-build writes and its ranks."""
    sides = {side.role: {"engine_dir": str(side.engine_dir), "tp_size": side.tp_size}
             for side in (plan.target, plan.draft)}
    return {"tensorrt_llm": RELEASE, "engine": plan.name, "max_draft_len": plan.k, **sides}


def write_script(plan: TrtllmPlan) -> Path:
    """The script, and the manifest next to it."""
    plan.root.mkdir(parents=True, exist_ok=True)
    plan.script.write_text(render_script(plan))
    plan.script.chmod(0o755)
    plan.manifest.write_text(json.dumps(manifest_data(plan), indent=1) + "\n")
    return plan.script


def build_trtllm(name: str, engines_dir: str | Path | None = None, *, k: int | None = None,
                 limits: EngineLimits = EngineLimits(), tp_size: int = 1) -> TrtllmBuild:
    """Write the TensorRT-LLM build script of engine ``name`` and run it when ``tensorrt_llm`` is
    importable (building the torch engine first: the script reads its GGUF files). Without it,
    nothing is fetched or built, and the message says what is missing and where the script is.
    ``tp_size``: the target engine's tensor-parallel ranks. Running the script is unverified:
    never run."""
    plan = plan_for(name, engines_dir, k=k, limits=limits, tp_size=tp_size)
    script = write_script(plan)
    if not tensorrt_llm_available():
        message = (missing_message("Building TensorRT-LLM engines") + f" The commands were written to {script}; "
                   f"run `bash {script}` there (set TRTLLM_EXAMPLES to TensorRT-LLM's examples/ directory).")
        log.warning("%s", message)
        return TrtllmBuild(script, False, message, plan.tp_size)
    if not (plan.engine / MANIFEST).is_file():  # a named engine not built yet
        build_engine(plan.name, plan.engine.parent)
        # Planned again now that the target's heads are known: tp_size must divide them.
        plan = plan_for(name, engines_dir, k=plan.k, limits=limits, tp_size=tp_size)
        script = write_script(plan)
    log.info("running %s", script)
    subprocess.run(["bash", str(script)], check=True)
    return TrtllmBuild(script, True, f"TensorRT-LLM engines built in {plan.target.engine_dir} (tp_size "
                       f"{plan.tp_size}) and {plan.draft.engine_dir}", plan.tp_size)
