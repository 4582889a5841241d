"""`trtssd triton-repo`: write a Triton model repository that serves trtssd.

    <out>/trtssd/config.pbtxt   Python backend, decoupled (streaming), max_batch_size 0 (the engine
                                batches), the inputs and outputs of trtssd/triton/tensors.py, and
                                the TRTSSD_* parameters naming the Python environment trtssd is
                                installed in (model.py enters it; see there why)
    <out>/trtssd/1/model.py     the model (a copy of trtssd/triton/model.py)
    <out>/trtssd/1/model.json   the engine directory and LLM options (model_options.py)

The engine is resolved (the default one built if needed) and the options are checked now, so a
repository that was written also loads.
"""

from __future__ import annotations

import logging
import os
import shutil
import site
import sys
from pathlib import Path

import trtssd
from trtssd.build import default_engine
from trtssd.config import RuntimeConfig, SpeculativeConfig, renamed_options, speculative_config
from trtssd.models.engine_dir import is_engine_dir
from trtssd.triton.model_options import ModelOptions
from trtssd.triton.tensors import INPUTS, OUTPUTS, TensorDef

log = logging.getLogger(__name__)

MODEL_NAME = "trtssd"
VERSION = "1"
MODEL_TEMPLATE = Path(__file__).with_name("model.py")
INSTANCE_KINDS = ("cpu", "gpu")


def write_repository(out: str | os.PathLike, engine: str | None = None, llm_options: dict | None = None,
                     options: dict | None = None, instance_kind: str = "cpu", gpus: tuple[int, ...] = (0,)) -> Path:
    """Write (or overwrite) ``<out>/trtssd``; returns the repository directory ``out``.

    engine: engine directory (None: the default engine, built on first use). llm_options: keyword
    options of trtssd.LLM. options: the other ModelOptions fields (max_waiting, log_level).
    instance_kind: "cpu" (one instance: the engine batches) or "gpu" (one instance per device
    of ``gpus``; unverified: not yet run on a GPU)."""
    llm_options = renamed_options(llm_options or {})  # the repository is written with today's names
    _check_llm_options(llm_options)
    if instance_kind not in INSTANCE_KINDS:
        raise ValueError(f"instance_kind must be one of {INSTANCE_KINDS}; got {instance_kind!r}")
    engine_dir = _engine_dir(engine)
    repository = Path(out).resolve()
    version_dir = repository / MODEL_NAME / VERSION
    version_dir.mkdir(parents=True, exist_ok=True)
    (repository / MODEL_NAME / "config.pbtxt").write_text(config_pbtxt(instance_kind, gpus))
    shutil.copyfile(MODEL_TEMPLATE, version_dir / "model.py")
    ModelOptions(str(engine_dir), llm_options, **(options or {})).write(version_dir)
    log.info("wrote the Triton model repository %s (engine %s)", repository, engine_dir)
    return repository


def config_pbtxt(instance_kind: str = "cpu", gpus: tuple[int, ...] = (0,)) -> str:
    lines = [
        "# Written by `trtssd triton-repo`; rewrite it with that command rather than by hand.",
        f'name: "{MODEL_NAME}"',
        'backend: "python"',
        "max_batch_size: 0  # trtssd batches requests itself (continuous batching)",
        "model_transaction_policy { decoupled: true }  # streaming: several responses per request",
        "input [", *_tensors(INPUTS), "]",
        "output [", *_tensors(OUTPUTS), "]",
        *_instance_group(instance_kind, gpus),
        "# The Python environment trtssd is installed in (the model enters it: see its model.py).",
        *(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}' for key, value in
          environment_parameters().items()),
    ]
    return "\n".join(lines) + "\n"


def environment_parameters() -> dict[str, str]:
    """This interpreter's environment, as model.py needs it to act as this interpreter."""
    package_root = str(Path(trtssd.__file__).resolve().parent.parent)  # so the stub imports this very trtssd
    site_dirs = [*site.getsitepackages(), package_root]
    values = {
        "TRTSSD_PYTHON": sys.executable,
        "TRTSSD_PREFIX": sys.prefix,
        "TRTSSD_SITE_PACKAGES": os.pathsep.join(dict.fromkeys(site_dirs)),
        "TRTSSD_PYTHON_VERSION": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    for key, value in values.items():
        if '"' in value or "\\" in value:
            raise ValueError(f"{key} {value!r}: paths with quotes or backslashes cannot go into config.pbtxt")
    return values


def _tensors(specs: tuple[TensorDef, ...]) -> list[str]:
    lines = []
    for i, spec in enumerate(specs):
        dims = ", ".join(str(d) for d in spec.dims)
        optional = " optional: true" if spec.optional else ""
        comma = "," if i < len(specs) - 1 else ""
        lines.append(f'  {{ name: "{spec.name}" data_type: {spec.data_type} dims: [ {dims} ]{optional} }}{comma}'
                     f"  # {spec.doc}")
    return lines


def _instance_group(kind: str, gpus: tuple[int, ...]) -> list[str]:
    if kind == "cpu":
        # One instance: each is a process with its own engine and draft rank, and one engine
        # already serves many requests at once.
        return ["instance_group [ { count: 1 kind: KIND_CPU } ]"]
    if not gpus or not all(isinstance(g, int) and g >= 0 for g in gpus):
        raise ValueError(f"gpus must be device indices >= 0; got {gpus!r}")
    groups = ",\n".join(f"  {{ count: 1 kind: KIND_GPU gpus: [ {g} ] }}" for g in gpus)
    return ["# UNVERIFIED: GPU instance groups have not run on a GPU yet (one instance per target device).",
            "instance_group [", groups, "]"]


def _engine_dir(engine: str | None) -> Path:
    if engine is None:
        return default_engine().resolve()
    path = Path(engine).expanduser().resolve()
    if not is_engine_dir(path):
        raise ValueError(f"engine {engine!r} is not an engine directory (no manifest.json); build one with "
                         "`trtssd build`")
    return path


def _check_llm_options(options: dict) -> None:
    """The checks LLM makes on its options, made now rather than when Triton loads the model."""
    spec = {k: v for k, v in options.items() if k in SpeculativeConfig.__dataclass_fields__}
    runtime = {k: v for k, v in options.items() if k in RuntimeConfig.__dataclass_fields__}
    unknown = sorted(set(options) - set(spec) - set(runtime) - {"launch"})
    if unknown:
        allowed = sorted({*SpeculativeConfig.__dataclass_fields__, *RuntimeConfig.__dataclass_fields__, "launch"})
        raise TypeError(f"unknown LLM option(s) {unknown}; allowed: {allowed}")
    speculative_config(spec)
    RuntimeConfig(**runtime)
