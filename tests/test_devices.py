"""Devices as configuration: target_device / draft_device (and transport) from RuntimeConfig,
LLM, the CLI, the Triton model options and the loaders; on "cpu" everything as before.

The end-to-end tests run the real draft rank (its own MPI job, POSIX shared buffers) on the tiny
models of tests/tiny_models.py; CUDA is only exercised by the GPU tests (marked, skipped here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import make_tiny_pair
from trtssd import LLM, ModelRef, SamplingParams
from trtssd.backends.loading import load_executor
from trtssd.backends.base import chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.bench.cli import build_parser as bench_parser
from trtssd.bench.cli import config_from_args as bench_config
from trtssd.cli import build_parser, main
from trtssd.cli_options import engine_options
from trtssd.config import RuntimeConfig, Transport
from trtssd.devices import resolve_device
from trtssd.models.config import ModelConfig, RopeConfig
from trtssd.models.engine_dir import _dequantized_draft
from trtssd.models.llama import LlamaModel
from trtssd.models.quant import groups_from_float
from trtssd.runtime.draft_client import _mpiexec
from trtssd.runtime.transport import require_mpi
from trtssd.triton.model_options import ModelOptions
from trtssd.triton.repository import write_repository

NO_CUDA = not torch.cuda.is_available()
needs_no_cuda = pytest.mark.skipif(not NO_CUDA, reason="checks the error for a machine without CUDA")
gpu = [pytest.mark.gpu, pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12]


def _generate(tiny, mode: str, launch: str = "spawn", **kw) -> list[list[int]]:
    target, draft = tiny
    with LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode=mode, launch=launch, max_model_len=128,
             plain_under_load=False, **kw) as llm:
        assert llm.runtime.target_device == kw.get("target_device", "cpu")
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    return [o.token_ids for o in outs]


# --- configuration -------------------------------------------------------------------------------


def test_runtime_config_devices_default_to_cpu_and_host_transport():
    rc = RuntimeConfig()
    assert (rc.target_device, rc.draft_device, rc.transport) == ("cpu", "cpu", Transport.AUTO)
    assert rc.resolved_transport is Transport.HOST


@pytest.mark.parametrize("value", ["cuda", "cuda:0", "cuda:3", "cpu"])
def test_runtime_config_accepts_device_names(value):
    # Only the form is checked here: a configuration may name a GPU this machine lacks.
    assert RuntimeConfig(target_device=value, draft_device=value).draft_device == value


@pytest.mark.parametrize("field", ["target_device", "draft_device"])
@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:-1", "cuda:01", "CUDA", "cuda:x", "", 0, None, "mps"])
def test_runtime_config_rejects_bad_device_names(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be 'cpu', 'cuda' or 'cuda:N'"):
        RuntimeConfig(**{field: value})


def test_transport_choice_and_errors():
    assert RuntimeConfig(draft_device="cuda").resolved_transport is Transport.CUDA_IPC
    assert RuntimeConfig(draft_device="cuda:1", transport="host").resolved_transport is Transport.HOST
    assert RuntimeConfig(draft_device="cuda", transport="cuda_ipc").transport is Transport.CUDA_IPC
    with pytest.raises(ValueError, match="transport must be one of 'auto', 'host', 'cuda_ipc'; got 'nvlink'"):
        RuntimeConfig(transport="nvlink")
    with pytest.raises(ValueError, match="transport 'cuda_ipc' needs draft_device 'cuda' or 'cuda:N'"):
        RuntimeConfig(transport="cuda_ipc")


def test_resolve_device_cpu():
    assert resolve_device("cpu", "target_device") == torch.device("cpu")


@needs_no_cuda
@pytest.mark.parametrize("value", ["cuda", "cuda:0"])
def test_resolve_device_without_cuda_is_a_clear_error(value):
    with pytest.raises(ValueError, match=rf"draft_device is '{value}' but CUDA is not available here"):
        resolve_device(value, "draft_device")


# --- LLM end to end ------------------------------------------------------------------------------


def test_llm_cpu_devices_end_to_end_match_the_defaults(tiny):
    """Explicit "cpu" on both ranks (and the host transport) gives exactly the default run's
    tokens, with the real draft rank, and those are the target's own greedy tokens."""
    default = _generate(tiny, "ssd")
    explicit = _generate(tiny, "ssd", target_device="cpu", draft_device="cpu", transport="host")
    assert explicit == default
    assert _generate(tiny, "ar", target_device="cpu") == default
    assert all(len(t) == 12 for t in default)


def test_llm_local_draft_on_cpu(tiny):
    assert _generate(tiny, "sd", launch="local", draft_device="cpu") == _generate(tiny, "ar")


@needs_no_cuda
@pytest.mark.parametrize("field", ["target_device", "draft_device"])
def test_llm_cuda_without_cuda_fails_before_starting(tiny, field):
    target, draft = tiny
    with pytest.raises(ValueError, match=rf"{field} is 'cuda' but CUDA is not available"):
        LLM(target=ModelRef(str(target)), draft=ModelRef(str(draft)), mode="ssd", **{field: "cuda"})


def test_llm_rejects_bad_device(tiny):
    target, _ = tiny
    with pytest.raises(ValueError, match="target_device must be 'cpu', 'cuda' or 'cuda:N'"):
        LLM(target=ModelRef(str(target)), mode="ar", target_device="tpu")


# --- loaders and executor ------------------------------------------------------------------------


def test_load_executor_places_weights_and_kv_on_the_device(tiny):
    ex = load_executor(ModelRef(str(tiny[0])), max_seqs=2, max_seq_len=32, device="cpu")
    assert ex.device == torch.device("cpu")
    assert all(t.device.type == "cpu" for pair in ex._kv for t in pair)  # noqa: SLF001 - the KV pool
    assert all(p.device.type == "cpu" for p in ex.model.parameters())


@needs_no_cuda
def test_load_executor_cuda_without_cuda_names_the_option(tiny):
    with pytest.raises(ValueError, match="draft_device is 'cuda:0' but CUDA is not available"):
        load_executor(ModelRef(str(tiny[1])), max_seqs=1, max_seq_len=32, device="cuda:0", device_field="draft_device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_executor_on_device_matches_cpu_logits(tiny, device):
    """The same forwards on ``device`` and on the CPU give the same logits (fp32); the KV pool is
    on the device, and logits come back to the host by default (the runtime's math runs there)."""
    path = str(tiny[0])
    ref = TorchExecutor.from_pretrained(path, max_seqs=1, max_seq_len=32)
    ex = TorchExecutor.from_pretrained(path, max_seqs=1, max_seq_len=32, device=device)
    assert ex._kv[0][0].device.type == device  # noqa: SLF001 - the KV pool
    for e in (ref, ex):
        e.add_sequence(0)
    prompt, more = [1, 5, 9, 2, 7, 3], [4, 8, 6]
    for e in (ref, ex):
        e.forward([chain_chunk(0, prompt, 0, last_logits_only=True)])
        e.commit(0, len(prompt))
    a, b = ref.forward([chain_chunk(0, more, len(prompt))])[0], ex.forward([chain_chunk(0, more, len(prompt))])[0]
    assert b.device.type == "cpu"
    assert (a - b).abs().max() < (1e-5 if device == "cpu" else 1e-3)  # GPU: other reduction orders


# --- command line and Triton model options -------------------------------------------------------


@pytest.mark.parametrize("command", [["serve"], ["triton-repo", "--out", "x"]])
def test_cli_device_flags_reach_the_llm_options(command):
    args = build_parser().parse_args(command + ["--target-device", "cuda:1", "--draft-device", "cuda",
                                                "--transport", "cuda_ipc"])
    opts = engine_options(args)
    assert (opts["target_device"], opts["draft_device"], opts["transport"]) == ("cuda:1", "cuda", "cuda_ipc")
    assert not {"target_device", "draft_device", "transport"} & set(engine_options(build_parser().parse_args(command)))


def test_cli_generate_has_the_device_flags():
    args = build_parser().parse_args(["generate", "--target-device", "cpu", "--draft-device", "cuda:0"])
    assert (args.target_device, args.draft_device, args.transport) == ("cpu", "cuda:0", None)


@pytest.mark.parametrize("command", [["generate"], ["serve"]])
def test_cli_bad_device_is_a_usage_error(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main(command + ["--draft-device", "gpu0"])
    assert exc.value.code == 2
    assert "draft_device must be 'cpu', 'cuda' or 'cuda:N'" in capsys.readouterr().err


@needs_no_cuda
def test_cli_cuda_without_cuda_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--target-device", "cuda"])
    assert exc.value.code == 2
    assert "target_device is 'cuda' but CUDA is not available" in capsys.readouterr().err


def test_triton_model_options_carry_the_devices(tmp_path):
    """A repository for a GPU host can be written anywhere: the names are checked for form, and
    reach the model's LLM through 1/model.json."""
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "manifest.json").write_text("{}")
    repo = write_repository(tmp_path / "repo", str(engine), {"target_device": "cuda:0", "draft_device": "cuda:1"})
    options = ModelOptions.read(repo / "trtssd" / "1")
    assert options.llm == {"target_device": "cuda:0", "draft_device": "cuda:1"}
    assert json.loads((repo / "trtssd" / "1" / "model.json").read_text())["llm"]["draft_device"] == "cuda:1"
    with pytest.raises(ValueError, match="target_device must be 'cpu', 'cuda' or 'cuda:N'"):
        write_repository(tmp_path / "bad", str(engine), {"target_device": "gpu"})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_int4_draft_off_the_cpu_runs_its_groups_dequantized(device):
    """The int4 kernel is CPU-only, so an engine's int4 draft on CUDA runs the same 4-bit groups
    dequantized (engine_dir._dequantized_draft): its logits are the dequantized model's."""
    cfg = ModelConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0),
                      tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(3)
    groups = {name: groups_from_float(torch.randn(m.out_features, m.in_features, generator=gen) * 0.2)
              for name, m in LlamaModel(cfg).linears()}
    params = {"embed.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen),
              "norm.weight": torch.ones(cfg.hidden_size)}
    for i in range(cfg.num_layers):
        params.update({f"layers.{i}.attn_norm.weight": torch.ones(cfg.hidden_size),
                       f"layers.{i}.mlp_norm.weight": torch.ones(cfg.hidden_size)})
    model = _dequantized_draft(cfg, groups, params, torch.device(device))
    assert model.device.type == device
    ref = LlamaModel(cfg)
    ref.load_weights({**params, **{f"{n}.weight": g.dequantize() for n, g in groups.items()}})
    kw = dict(max_seqs=1, max_seq_len=16)
    ours, theirs = TorchExecutor(model, **kw), TorchExecutor(ref.eval(), **kw)
    for e in (ours, theirs):
        e.add_sequence(0)
    tokens = [3, 14, 15, 92, 6]
    a, b = (e.forward([chain_chunk(0, tokens, 0)])[0] for e in (ours, theirs))
    assert (a - b).abs().max() < (1e-5 if device == "cpu" else 1e-3)


# --- without MPI, and both ranks on a GPU ---------------------------------------------------------

NO_MPI_SCRIPT = """
import sys
class NoMPI:  # this interpreter has no mpi4py
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'mpi4py':
            raise ImportError('no mpi4py here')
sys.meta_path.insert(0, NoMPI())
from trtssd import LLM, ModelRef, SamplingParams
target, draft = ModelRef(sys.argv[1]), ModelRef(sys.argv[2])
with LLM(target=target, draft=draft, mode='ssd', launch='local', max_model_len=64, plain_under_load=False) as llm:
    print(llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids)
try:
    LLM(target=target, draft=draft, mode='sd', max_model_len=64)
except RuntimeError as err:
    print('spawn:', err)
"""


def test_local_launch_needs_no_mpi4py(tiny):
    """The GPU check's fallback: launch='local' runs without mpi4py; 'spawn' says what it lacks."""
    out = subprocess.run([sys.executable, "-c", NO_MPI_SCRIPT, str(tiny[0]), str(tiny[1])], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(eval(lines[0])) == 8  # noqa: S307 - our own printed list
    assert lines[1].startswith("spawn: launch='spawn' needs mpi4py and an MPI library")


def _mpi_available() -> bool:
    try:
        require_mpi("the spawn launch")
        return bool(_mpiexec())
    except RuntimeError:
        return False


@pytest.mark.parametrize("launch", ["local", "spawn"])
@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_both_ranks_on_cuda_keep_greedy_outputs(tiny, launch):
    """Target and draft on the GPU (spawn: the draft's own process, rows through CUDA IPC): sd and
    ssd give the GPU ar run's tokens."""
    if launch == "spawn" and not _mpi_available():
        pytest.skip("no MPI here: the spawn launch is not available")
    cuda = dict(target_device="cuda", draft_device="cuda")
    ar = _generate(tiny, "ar", **cuda)
    for mode in ("sd", "ssd"):
        assert _generate(tiny, mode, launch=launch, **cuda) == ar


def test_bench_device_flags():
    cfg = bench_config(bench_parser().parse_args(["--target-device", "cuda:0", "--draft-device", "cuda"]))
    assert (cfg.target_device, cfg.draft_device) == ("cuda:0", "cuda")
    assert bench_config(bench_parser().parse_args([])).target_device == "cpu"
    with pytest.raises(ValueError, match="draft_device must be 'cpu', 'cuda' or 'cuda:N'"):
        bench_config(bench_parser().parse_args(["--draft-device", "gpu"]))
