"""What llama.cpp's decoding of 4 rows costs in the layout trtssd's ggml executor needs, and in
llama-server's, and which layouts keep a row's logits independent of its batch.

Layouts: flash attention on, off or llama.cpp's "auto"; cells in one pool (so tree lanes can share
cells, trtssd's) or a stream per sequence (llama-server's slots). 2 threads, no repacking.
- speed: decode steps of 4 rows, one per sequence of 200 cells;
- invariance: a 4-token verify chain against one-row decodes of the same tokens, alone and beside
  another sequence's rows, bit for bit; a plain probe without the executor's cell ordering
  (trtssd/backends/ggml_backend.py), which a pool needs.

    .venv/bin/python docs/bench/ggml-batch4-decode-layouts/run.py [model.gguf]
"""

import sys
import time

import llama_cpp as L

from trtssd.backends.ggml_backend import llama_library
from trtssd.bench.llama_context import RawContext
from trtssd.models.smollm2 import ensure_smollm2_gguf

SEQS, PROMPT_LEN, STEPS = 4, 200, 60
PROMPT = [100 + (i * 7) % 500 for i in range(PROMPT_LEN)]
CHAIN = [11, 22, 33, 44]
FLASH = {1: "on", 0: "off", -1: "auto"}


class Context(RawContext):
    """A context in one layout: cells in one pool (unified) or a stream per sequence; flash attention."""

    def __init__(self, model, vocab: int, unified: bool, flash: int):
        super().__init__(model, vocab, n_ctx=4096, n_seq_max=SEQS, unified=unified, flash=flash)


def step_ms(c: Context) -> float:
    for s in range(SEQS):
        c.decode([(t, i, s, i == PROMPT_LEN - 1) for i, t in enumerate(PROMPT)])
    times = []
    for n in range(STEPS + 5):
        start = time.perf_counter()
        c.decode([(200 + s, PROMPT_LEN + n, s, True) for s in range(SEQS)])
        times.append(time.perf_counter() - start)
    return 1e3 * sum(times[5:]) / STEPS


def invariance(c: Context) -> str:
    for s in range(SEQS):
        c.decode([(t, i, s, False) for i, t in enumerate(PROMPT[:150] if s == 2 else PROMPT)])
    rows = [c.decode([(t, PROMPT_LEN + j, 0, True)])[0] for j, t in enumerate(CHAIN)]
    chain = c.decode([(t, PROMPT_LEN + j, 1, True) for j, t in enumerate(CHAIN)])
    beside = c.decode([(t, PROMPT_LEN + j, 3, True) for j, t in enumerate(CHAIN)] + [(5, 150, 2, True), (6, 151, 2, True)])
    diff = max(float(abs(chain[j] - rows[j]).max()) for j in range(len(CHAIN)))
    return (f"chain == rows {all((chain[j] == rows[j]).all() for j in range(4))}, beside another sequence == rows "
            f"{all((beside[j] == rows[j]).all() for j in range(4))}, largest difference {diff:.2e}")


def main() -> None:
    llama_library()
    path = sys.argv[1] if len(sys.argv) > 1 else str(ensure_smollm2_gguf())
    mp = L.llama_model_default_params()
    mp.n_gpu_layers, mp.use_extra_bufts = 0, False
    model = L.llama_model_load_from_file(path.encode(), mp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    for unified in (True, False):
        for flash in (1, 0, -1):
            results = []
            for measure in (step_ms, invariance):
                c = Context(model, vocab, unified, flash)
                results.append(measure(c))
                c.close()
            print(f"cells {'one pool' if unified else 'a stream per sequence'}, flash attention {FLASH[flash]}: "
                  f"{results[0]:.1f} ms per step ({SEQS * 1e3 / results[0]:.1f} tok/s); {results[1]}", flush=True)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
