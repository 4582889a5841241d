import sys
from pathlib import Path

import pytest

# tests/ helpers (tiny_models) importable from every test module
sys.path.insert(0, str(Path(__file__).parent))

# `pytest --fast`: the fast tier's option, selection and guard (tests/fast_tier.py).
from fast_tier import (  # noqa: E402, F401
    fast_tier_guard, pytest_addoption, pytest_collection_modifyitems, pytest_runtest_setup)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Llama target and a draft that mostly agrees with it (no tokenizer)."""
    from tiny_models import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_llm(tiny_pair):
    """Opens an `LLM` on ``tiny_pair`` in this process (ssd and max_model_len 256 unless given), with
    any other option; ``target``: a copy of the tiny target (with a tokenizer, say) instead."""
    from trtssd import LLM, ModelRef

    def make(target: Path | None = None, **options):
        return LLM(target=ModelRef(str(target or tiny_pair[0])), draft=ModelRef(str(tiny_pair[1])),
                   launch="local", **{"mode": "ssd", "max_model_len": 256, **options})

    return make


@pytest.fixture(scope="module")
def smollm2():
    """The default engine's tokenizer (SmolLM2's byte-level BPE)."""
    from trtssd.build import default_engine
    from trtssd.models.tokenizer import load_tokenizer

    return load_tokenizer(default_engine())


@pytest.fixture
def queue():
    """Queue a request on a `TargetLoop` as `LLM` does (new_sequence, then add); returns its seq_id."""
    def add(loop, prompt, params) -> int:
        seq = loop.new_sequence(list(prompt), params)
        loop.add(seq)
        return seq.seq_id

    return add


@pytest.fixture
def no_leaked_shared_memory():
    """The test leaves /dev/shm and the temporary directory as it found them: no buffer of ours,
    no segment or hydra file of MPICH's (tests/draft_jobs.py)."""
    from draft_jobs import hydra_files, in_use_segments, open_hydra_files, shm_segments

    before, hydra_before = shm_segments(), hydra_files()
    yield
    leaked = shm_segments() - before - in_use_segments()
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"
    leaked_files = hydra_files() - hydra_before - open_hydra_files()
    assert not leaked_files, f"MPICH hydra files left behind: {sorted(leaked_files)}"
