"""What llama.cpp would cost as the draft executor: forward time by rows on the embedded GGUF.

An alternative executor for the draft: the same Q4_1 GGUF run by llama.cpp. This times
``llama_decode`` of n new tokens (one sequence, causal) after a 200-token context, 1 thread, so
the numbers sit beside ``scripts/bench_draft.py``'s ``forward_cpu_ms_by_tokens``.

Optional: needs ``pip install llama-cpp-python`` (no wheel on PyPI; it compiles llama.cpp, ~4-5
minutes on 2 cores). ``--extra-bufts`` lets llama.cpp repack weights for AMX; on this machine that
path crashes (SIGSEGV in ggml_backend_amx_mul_mat), which is why it is off by default.

Usage: .venv/bin/python scripts/bench_llamacpp.py [--out docs/bench/llamacpp.json]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

from trtssd.bench.report import write_json

log = logging.getLogger("bench_llamacpp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--extra-bufts", action="store_true", help="allow llama.cpp's weight repacking (AMX)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import llama_cpp as L

    if args.gguf is None:
        from trtssd.models.smollm2 import ensure_smollm2_gguf

        args.gguf = ensure_smollm2_gguf()
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.use_extra_bufts = args.extra_bufts
    model = L.llama_model_load_from_file(str(args.gguf).encode(), mparams)
    cparams = L.llama_context_default_params()
    n_batch = max(max(args.rows), args.context)
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = args.context + n_batch + 16, n_batch, n_batch
    cparams.n_threads = cparams.n_threads_batch = 1
    ctx = L.llama_init_from_model(model, cparams)
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(n_batch, 0, 1)

    def decode(tokens: list[int], start: int) -> float:
        batch.n_tokens = len(tokens)
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, start + i, 1, 1
            batch.seq_id[i][0] = 0
        t0 = time.thread_time()
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return (time.thread_time() - t0) * 1e3

    decode([100 + i % 1000 for i in range(args.context)], 0)
    result = {}
    for rows in args.rows:
        times = []
        for _ in range(args.repeats):
            times.append(decode([5] * rows, args.context))
            L.llama_memory_seq_rm(memory, 0, args.context, -1)
        result[rows] = round(statistics.median(times), 2)
        log.info("%d rows: %.2f ms", rows, result[rows])
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    report = {"gguf": str(args.gguf), "llama_cpp_python": L.__version__, "threads": 1, "context": args.context,
              "extra_bufts": args.extra_bufts, "forward_cpu_ms_by_rows": result,
              "system_info": L.llama_print_system_info().decode()}
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
