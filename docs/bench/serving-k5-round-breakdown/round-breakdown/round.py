import json, logging, sys, time
from trtssd import LLM, SamplingParams
prompts = ["def fibonacci(n):", "Write a short story about a robot.", "Explain TCP handshakes.",
           "List five fruits and their colours.", "What is the capital of France? Answer in detail."]
mode = sys.argv[1] if len(sys.argv) > 1 else "ssd"
with LLM(mode=mode) as llm:
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16))
    for p in prompts:
        t0 = time.perf_counter()
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))[0]
        dt = time.perf_counter() - t0
        m = out.metrics
        keys = ["mean_acceptance_length", "cache_hit_rate", "num_drafts", "verify_time_s", "draft_wait_time_s",
                "round_time_s", "draft_answer_time_s", "draft_prespec_time_s", "plain_rounds", "mean_tree_branches"]
        print(f"{dt:.2f}s", {k: (round(m[k], 3) if isinstance(m[k], float) else m[k]) for k in keys if k in m}, flush=True)
