"""Which llama.cpp CPU kernels keep a row's logits independent of its batch, and what each way
of keeping rows exact costs.

Run once per kernel setting (llama.cpp reads its switches once per process); run.sh runs the
three settings on both engines' target files and writes results.txt:

    .venv/bin/python docs/bench/ggml-exact-rows-full-batch/run.py model.gguf
    GGML_CPU_TILED_MM=0 .venv/bin/python docs/bench/ggml-exact-rows-full-batch/run.py model.gguf
    GGML_CPU_TILED_MM_FORCE=1 .venv/bin/python docs/bench/ggml-exact-rows-full-batch/run.py model.gguf

Layout as trtssd's target executor uses it: one pool of cells, flash attention on, no repacking,
2 threads. Per setting it reports
- invariance: 16 sequences' next rows decoded in one forward of 16 tokens, and one verify chain
  of 6 tokens inside a forward of 48, against the same rows in forwards of 2 tokens (the executor's
  smallest piece), bit for bit;
- speed: a decode step of 16 rows as one forward and as pieces of at most 7 tokens (the layout exact
  rows need while the tiled K-quant matmul is on), one row alone and one row beside a filler row
  over a 600-cell cache, and a 512-token prompt.
"""

import os
import sys
import time

import llama_cpp as L
import numpy as np

from trtssd.backends.ggml_backend import llama_library
from trtssd.bench.llama_context import RawContext

SEQS, PROMPT_LEN = 16, 600
FILLER = SEQS + 1
PROMPT = [100 + (i * 7) % 500 for i in range(PROMPT_LEN)]


class Context(RawContext):
    """The executor's layout: one pool of cells, flash attention on; filler rows dropped at once."""

    def __init__(self, model, vocab: int):
        super().__init__(model, vocab, n_ctx=16384, n_seq_max=SEQS + 2)

    def decode(self, entries) -> np.ndarray:
        out = super().decode(entries)
        L.llama_memory_seq_rm(self.memory, FILLER, -1, -1)
        return out

    def prefill(self, seq: int, n: int) -> None:
        for start in range(0, n, 512):
            self.decode([(t, start + i, seq, False) for i, t in enumerate(PROMPT[start:min(n, start + 512)])])


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - start) / reps


def invariance(model, vocab) -> str:
    c = Context(model, vocab)
    for s in range(SEQS):
        c.prefill(s, 40 + s)
    # Reference rows: each in a 2-token forward beside a filler sequence (SEQS + 1), as the executor's pieces.
    refs = []
    for s in range(SEQS):
        refs.append(c.decode([(300 + s, 40 + s, s, True), (1, 0, FILLER, False)])[0])
        L.llama_memory_seq_rm(c.memory, s, 40 + s, -1)
    wide = c.decode([(300 + s, 40 + s, s, True) for s in range(SEQS)])
    rows_equal = all((wide[s] == refs[s]).all() for s in range(SEQS))
    rows_diff = max(float(abs(wide[s] - refs[s]).max()) for s in range(SEQS))
    for s in range(SEQS):
        L.llama_memory_seq_rm(c.memory, s, 40 + s, -1)
    chain = [11, 22, 33, 44, 55, 66]
    alone = [c.decode([(t, 40 + j, 0, True), (1, 0, FILLER, False)])[0] for j, t in enumerate(chain)]
    L.llama_memory_seq_rm(c.memory, 0, 40, -1)
    entries = [(t, 40 + j, 0, True) for j, t in enumerate(chain)]
    entries += [(t, 40 + s + j, s, False) for s in range(1, 8) for j, t in enumerate(chain)]
    mixed = c.decode(entries)
    chain_equal = all((mixed[j] == alone[j]).all() for j in range(len(chain)))
    chain_diff = max(float(abs(mixed[j] - alone[j]).max()) for j in range(len(chain)))
    c.close()
    return (f"16 rows in one forward == rows in pieces: {rows_equal} (largest difference {rows_diff:.2e}); "
            f"a 6-token chain in a 48-token forward == its rows one by one: {chain_equal} ({chain_diff:.2e})")


def speed(model, vocab) -> str:
    c = Context(model, vocab)
    for s in range(SEQS):
        c.prefill(s, 64)
    pos = [64]

    def step(pieces):
        n = pos[0]
        for lo in range(0, SEQS, pieces):
            c.decode([(200 + s, n, s, True) for s in range(lo, min(SEQS, lo + pieces))])
        pos[0] += 1
    one_forward = timed(lambda: step(SEQS), 10)
    in_pieces = timed(lambda: step(6), 10)  # 16 rows as 6 + 6 + 4: each piece at most 7 tokens
    c.close()
    c = Context(model, vocab)
    c.prefill(0, PROMPT_LEN)
    n = [PROMPT_LEN]

    def single(filler):
        entries = [(5, n[0], 0, True)] + ([(1, 0, FILLER, False)] if filler else [])
        c.decode(entries)
        n[0] += 1
    alone = timed(lambda: single(False), 20)
    with_filler = timed(lambda: single(True), 20)
    c.close()
    c = Context(model, vocab)
    seq = [0]

    def prompt():
        c.prefill(seq[0] % SEQS, 512)
        seq[0] += 1
    prefill = timed(prompt, 3)
    c.close()
    return (f"decode step of 16 rows: one forward {one_forward:.1f} ms, pieces of 6/6/4 {in_pieces:.1f} ms; "
            f"one row over {PROMPT_LEN} cells: alone {alone:.1f} ms, beside a filler row {with_filler:.1f} ms; "
            f"512-token prompt {prefill:.0f} ms")


def main() -> None:
    llama_library()
    path = sys.argv[1]
    mp = L.llama_model_default_params()
    mp.n_gpu_layers, mp.use_extra_bufts = 0, False
    model = L.llama_model_load_from_file(path.encode(), mp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    setting = " ".join(f"{k}={os.environ[k]}" for k in ("GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE") if k in os.environ)
    print(f"{path}, {setting or 'llama.cpp defaults'}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print("  " + invariance(model, vocab), flush=True)
    print("  " + speed(model, vocab), flush=True)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
