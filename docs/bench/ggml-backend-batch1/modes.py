"""ar, sd and ssd on one engine, batch 1: tok/s (prefill included) and whether sd/ssd equal ar.

Usage: modes.py ENGINE MODES MAX_TOKENS [K]
"""
import sys, time, logging
from trtssd import LLM, SamplingParams
eng = sys.argv[1]; modes = sys.argv[2].split(","); n = int(sys.argv[3]) if len(sys.argv) > 3 else 96
prompts = ["def fibonacci(n):", "Write a haiku about the sea.", "The capital of France is", "import numpy as np\n"]
outs = {}
for mode in modes:
    kw = dict(k=int(sys.argv[4])) if len(sys.argv) > 4 and mode != "ar" else {}
    with LLM(eng, mode=mode, max_batch=4, max_seq_len=512, plain_under_load=False, **kw) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))
        res = []; t0 = time.perf_counter(); toks = 0
        for p in prompts:
            o = llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
            res.append(o.token_ids); toks += len(o.token_ids)
        dt = time.perf_counter() - t0
        m = o.metrics
        print(mode, f"{toks/dt:.1f} tok/s", {k: m.get(k) for k in ("mean_acceptance_length", "cache_hit_rate")}, flush=True)
        outs[mode] = res
for mode in modes[1:]:
    print(mode, "== ar:", outs[mode] == outs[modes[0]])
