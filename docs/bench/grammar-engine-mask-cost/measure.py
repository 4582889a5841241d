"""Per-token mask cost, fork cost and compile time of xgrammar and llguidance on Qwen2.5's
151,936-token vocabulary, following one JSON document of a nested schema token by token.
Writes results.json beside itself. Run: bash run.sh (needs engines/qwen2.5-coder-1.5b-ggml and
`pip install llguidance` in .venv; xgrammar is a trtssd dependency)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import time
from pathlib import Path

import llguidance as llg
import llguidance.hf
import llguidance.torch as lgt
import xgrammar as xgr

from trtssd.models.tokenizer import load_tokenizer

ENGINE = Path(__file__).resolve().parents[3] / "engines" / "qwen2.5-coder-1.5b-ggml"
VOCAB, EOS = 151936, 151645
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}, "role": {"enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "address"]}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "role": "admin", "address": {"city": "London", "zip": "12345"}}


def stats_us(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"p50_us": round(statistics.median(ordered) * 1e6, 2), "p90_us": round(ordered[int(0.9 * len(ordered))] * 1e6, 2)}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def xgrammar_run(tok, ids: list[int]) -> dict:
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                      separators=(", ", ": ")))
    matcher, bitmask, masks, forks = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, VOCAB), [], []
    for tok_id in ids:
        masks.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask))[1])
        forks.append(timed(matcher.fork)[1])
        assert matcher.accept_token(tok_id)
    return {"compile_s": round(compile_s, 4), "mask": stats_us(masks), "fork": stats_us(forks), "tokens": len(ids)}


def llguidance_run(tok, ids: list[int]) -> dict:
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=EOS)
    grammar = llg.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    matcher, compile_s = timed(lambda: llg.LLMatcher(lltok, grammar))
    bitmask, masks, forks = lgt.allocate_token_bitmask(1, VOCAB), [], []
    for tok_id in ids:
        masks.append(timed(lambda: lgt.fill_next_token_bitmask(matcher, bitmask))[1])
        forks.append(timed(matcher.deep_copy)[1])
        assert matcher.consume_token(tok_id), matcher.get_error()
    return {"compile_s": round(compile_s, 4), "mask": stats_us(masks), "fork": stats_us(forks), "tokens": len(ids)}


def main() -> None:
    tok = load_tokenizer(ENGINE)
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False) + [EOS]
    results = {"vocab_size": VOCAB, "document": json.dumps(DOC), "load_average": os.getloadavg(),
               "xgrammar": {"version": importlib.metadata.version("xgrammar"), **xgrammar_run(tok, ids)},
               "llguidance": {"version": importlib.metadata.version("llguidance"), **llguidance_run(tok, ids)}}
    out = Path(__file__).with_name("results.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
