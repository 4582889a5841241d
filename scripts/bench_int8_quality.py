"""How far an int8 target's next-token distributions are from its fp32 model's, per activation
scheme, teacher-forced on fixed texts (docs/draft.md, "Int8 projections").

For each scheme the target's projections are made int8 (trtssd.models.int8_dynamic) with the
given activation levels per projection; every position's logits are compared with fp32's: top-1
agreement, KL(fp32 || int8) mean and p99, and the mean negative log-likelihood of the text.

Usage:
    .venv/bin/python scripts/bench_int8_quality.py engines/qwen2.5-coder-1.5b \
        --out docs/bench/int8-target/quality.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from trtssd.backends.base import chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.bench.report import machine_info, write_json
from trtssd.models.engine_dir import load_manifest
from trtssd.models.int8_dynamic import Int8DynamicLinear
from trtssd.models.loader import load_model
from trtssd.models.tokenizer import load_tokenizer

log = logging.getLogger("bench_int8_quality")

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ("trtssd/spec_decode/verify.py", "README.md", "docs/draft.md")  # code, prose, mixed
CHARS, TOKENS = 2500, 400
# Projections by the last part of their name (layers.N.attn.qkv, ..., lm_head) -> levels.
SCHEMES: dict[str, Callable[[str], int]] = {
    "one level": lambda name: 1,
    "two levels in down": lambda name: 2 if name.endswith("down") else 1,
    "two levels in down and lm_head": lambda name: 2 if name.endswith("down") or name == "lm_head" else 1,
    "two levels": lambda name: 2,
}


def text_ids(tokenizer) -> list[list[int]]:
    return [tokenizer((ROOT / t).read_text()[:CHARS])["input_ids"][:TOKENS] for t in TEXTS]


def logits_of(gguf: Path, texts: list[list[int]], levels: Callable[[str], int] | None) -> list[torch.Tensor]:
    model = load_model(gguf, torch.float32)
    if levels is not None:
        for name, module in list(model.linears()):
            model.set_linear(name, Int8DynamicLinear.from_linear(module, levels(name)))
    executor = TorchExecutor(model, max_seqs=1, max_seq_len=TOKENS + 8)
    out = []
    for ids in texts:
        executor.add_sequence(0)
        out.append(executor.forward([chain_chunk(0, ids, 0)])[0].float())
        executor.release(0)
    return out


def compare(int8: list[torch.Tensor], fp32: list[torch.Tensor], texts: list[list[int]]) -> dict:
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)) for a, b in zip(int8, fp32)]).float().mean()
    kl = torch.cat([F.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1)
                    for a, b in zip(int8, fp32)])
    return {"top1_agreement": round(agree.item(), 4), "kl_mean": round(kl.mean().item(), 4),
            "kl_p99": round(kl.quantile(0.99).item(), 4), "nll": round(nll(int8, texts), 4)}


def nll(logits: list[torch.Tensor], texts: list[list[int]]) -> float:
    return torch.cat([F.cross_entropy(x[:-1], torch.tensor(ids[1:]), reduction="none")
                      for x, ids in zip(logits, texts)]).mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", help="engine directory whose target GGUF is measured")
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    engine = Path(args.engine)
    gguf = engine / load_manifest(engine)["target"]["path"]
    texts = text_ids(load_tokenizer(engine))
    fp32 = logits_of(gguf, texts, None)
    results = {"fp32": {"nll": round(nll(fp32, texts), 4)}}
    for scheme, levels in SCHEMES.items():
        results[scheme] = compare(logits_of(gguf, texts, levels), fp32, texts)
        log.info("%s: %s", scheme, results[scheme])
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "texts": [f"{t} (first {CHARS} characters, at most {TOKENS} tokens)" for t in TEXTS],
        "results": results,
    }
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
