"""Greedy ssd equals ar token for token on the default engine (SmolLM2-135M target, int4
self-draft): 4 prompts x 128 tokens at batch 4, then the first 2 of them again at batch 1 (the
end-to-end check; 20 prompts at both batch sizes cost CI 8 minutes, 8 and 4 still 93 s, for
no path these miss: every forward is memory-bound, so a second wave of 4 doubled the time).

sd is not run here (it cost CI 67 s): its verification is the one ssd's backups and hits go
through, and greedy sd = ar is checked on tiny models at batch 1 and 4 (tests/test_runtime.py)
and on the real Qwen pair at batch 4 (tests/test_qwen_pair.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtssd import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

PROMPTS_DIR = Path(__file__).parents[1] / "scripts" / "prompts"
N_PROMPTS, N_TOKENS, N_SINGLE = 4, 128, 2


def _prompts(n: int) -> list[str]:
    """Round-robin over our three prompt sets, so every kind is covered."""
    sets = [[json.loads(line)["prompt"] for line in (PROMPTS_DIR / name).read_text().splitlines() if line.strip()]
            for name in ("chat.jsonl", "math.jsonl", "instructions.jsonl")]
    mixed = [row for group in zip(*sets) for row in group]
    return mixed[:n]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    rows = _prompts(N_PROMPTS)
    assert len(rows) == N_PROMPTS
    return rows


PARAMS = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ar_tokens(prompts) -> list[list[int]]:
    with LLM(mode="ar", max_batch=4, max_model_len=512) as llm:
        out = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    assert all(len(o) == N_TOKENS for o in out)
    return out


def _mismatches(reference: list[list[int]], got: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(reference, got, strict=True)) if a != b]


def test_greedy_ssd_equals_ar_at_batch_4_and_1(prompts, ar_tokens):
    with LLM(mode="ssd", max_batch=4, max_model_len=512, plain_under_load=False) as llm:
        batched = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        single = [llm.generate([p], PARAMS)[0].token_ids for p in prompts[:N_SINGLE]]
        summary = llm.metrics.summary()
    assert summary["degraded_rounds"] == 0 and summary["num_drafts"] > 0
    assert not _mismatches(ar_tokens, batched), f"ssd batch 4 differs from ar on prompts {_mismatches(ar_tokens, batched)}"
    assert not _mismatches(ar_tokens[:N_SINGLE], single), \
        f"ssd batch 1 differs from ar on prompts {_mismatches(ar_tokens[:N_SINGLE], single)}"
    assert summary["cache_hits"] > 0  # the pre-speculation path, not only backups, was verified
