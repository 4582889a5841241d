"""Launch "world" (trtssd/runtime/world.py): every rank one process of a real ``mpiexec -n T+1``
job, ranks 0..T-1 the target (a tensor-parallel torch target at T > 1), the last rank the draft.

- Greedy ssd under ``mpiexec -n 3`` (T = 2, a tiny pair, the Python API) and ``mpiexec -n 4``
  (T = 3, the default engine, ``trtssd generate``) decodes the tokens of plain T = 1 ar.
- A killed follower ends the job (MPICH kills the other ranks) and nothing is left behind: no
  process, and no shared-memory segment, MPICH's own included.
- A job of the wrong size is refused on every rank, naming the option and the size it needs; a
  rank 0 that cannot start (a size that does not split the model) ends the job with its reason,
  instead of leaving the other ranks waiting for it.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trtssd import LLM, ModelRef, SamplingParams
from trtssd.processes import start_time

pytestmark = pytest.mark.mpi

BINDIR = Path(sys.executable).parent
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
MAX_TOKENS = 24

# The job's rank 0: the script every rank runs, as a user would write it.
SCRIPT = """
import json, os, signal, sys
from mpi4py import MPI
from trtssd import LLM, ModelRef, SamplingParams
from trtssd.runtime.world import serve_world_rank

target, draft, size, action = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
pids = MPI.COMM_WORLD.allgather(os.getpid())  # rank 0, its followers, the draft
if serve_world_rank(size):
    sys.exit(0)
with LLM(target=ModelRef(target), draft=ModelRef(draft), mode="ssd", launch="world", tensor_parallel_size=size,
         max_model_len=128, plain_under_load=False) as llm:
    assert pids[-1] == llm.loop.draft.pid
    print(json.dumps({"pids": pids}), flush=True)
    if action == "kill":
        os.kill(pids[1], signal.SIGKILL)
    out = llm.generate(json.loads(sys.argv[5]), SamplingParams(temperature=0, max_tokens=%d))
    print(json.dumps({"ids": [o.token_ids for o in out], "hits": llm.metrics.cache_hits}), flush=True)
""" % MAX_TOKENS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    from tiny_models import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """No new segment of ours or MPICH's outlives a test (the jobs are over when each returns)."""
    before = _segments()
    yield
    left = _segments() - before
    assert not left, f"shared memory left behind: {sorted(left)}"


def _segments() -> set[str]:
    return {os.path.basename(p) for p in glob.glob("/dev/shm/trtssd-*") + glob.glob("/dev/shm/mpich_*")}


def _mpiexec(n: int, *command: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BINDIR}:{os.environ.get('PATH', '')}", PYTHONPATH=str(Path(__file__).parents[1]))
    return subprocess.run([str(BINDIR / "mpiexec"), "-n", str(n), *command], capture_output=True, text=True,
                          timeout=timeout_s, env=env)


def _run_script(tmp_path: Path, tiny, size: int, action: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    target, draft = tiny
    return _mpiexec(size + 1, sys.executable, str(script), str(target), str(draft), str(size), action,
                    json.dumps(PROMPTS))


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _ar_reference(target: Path, prompts, **options) -> list[list[int]]:
    with LLM(target=ModelRef(str(target)), mode="ar", launch="local", max_model_len=128, **options) as llm:
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]


def test_two_target_ranks_and_a_draft_under_mpiexec_decode_what_one_rank_does(tiny, tmp_path):
    proc = _run_script(tmp_path, tiny, 2, "generate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    started, result = _lines(proc.stdout)
    assert len(set(started["pids"])) == 3  # rank 0, its follower, the draft: three processes
    assert result["ids"] == _ar_reference(tiny[0], PROMPTS)
    assert result["hits"] > 0  # the draft's pre-speculation was used


def test_a_killed_follower_ends_the_job_and_leaves_nothing_behind(tiny, tmp_path):
    proc = _run_script(tmp_path, tiny, 2, "kill")
    assert proc.returncode != 0  # MPICH's launcher ends the job when a rank dies
    lines = _lines(proc.stdout)
    assert len(lines) == 1, proc.stdout  # started, never finished
    pids = lines[0]["pids"]
    deadline = time.monotonic() + 30
    while any(start_time(p) is not None for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(start_time(p) is None for p in pids), "a rank outlived its job"


def test_a_job_of_the_wrong_size_is_refused_on_every_rank(tiny, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    target, draft = tiny
    proc = _mpiexec(2, sys.executable, str(script), str(target), str(draft), "2", "generate", json.dumps(PROMPTS),
                    timeout_s=120)
    assert proc.returncode != 0
    message = ("launch 'world' with tensor_parallel_size=2 needs mpiexec -n 3 (ranks 0..1 the target, rank 2 the "
               "draft); this job has 2 ranks")
    assert proc.stderr.count(message) == 2, proc.stderr[-3000:]


def test_a_rank_0_that_cannot_start_ends_the_job_with_its_reason(tiny, tmp_path):
    proc = _run_script(tmp_path, tiny, 3, "generate")  # 4 heads over 2 KV heads: T = 3 does not split them
    assert proc.returncode != 0
    assert "rank 0 could not start (ValueError: tensor_parallel_size=3 does not divide this model" in proc.stderr
    assert "allowed values: 1, 2" in proc.stderr


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_the_default_engine_on_three_target_ranks_from_the_command_line(mode):
    """SmolLM2's 9 heads over 3 KV heads split 3 ways (not 2): ``trtssd generate`` on every rank
    of ``mpiexec -n 4`` gives the tokens of one rank's ar, in sd and in ssd."""
    from trtssd.build import default_engine

    engine = default_engine()
    # 256 positions: the four ranks' KV pools and scratch fit beside whatever else the machine runs
    # (each rank checks its reservation against the host's free memory at its start).
    args = ["--engine", str(engine), "--prompt", "The capital of France is", "--prompt", "def fibonacci(n):",
            "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json", "--max-model-len", "256"]
    proc = _mpiexec(4, str(BINDIR / "trtssd"), "generate", *args, "--mode", mode, "--launch", "world",
                    "--tensor-parallel-size", "3", "--no-plain-under-load")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)["outputs"]
    ref = subprocess.run([str(BINDIR / "trtssd"), "generate", *args, "--mode", "ar", "--launch", "local"],
                         capture_output=True, text=True, timeout=600, check=True)
    want = json.loads(ref.stdout)["outputs"]
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert sum(o["metrics"]["num_accepted_tokens"] for o in got) > 0  # it speculated
