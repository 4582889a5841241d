"""A llama.cpp context driven directly through llama-cpp-python's low-level API, for scripts that
measure llama.cpp's own kernels and cache layouts without trtssd's executor between them and
llama.cpp (docs/bench/ggml-exact-rows-full-batch)."""

from __future__ import annotations

import numpy as np

from trtssd.backends.ggml_backend import llama_library


class RawContext:
    """One context over a loaded model; ``decode`` takes (token, position, sequence id, wants
    logits) entries as one llama_decode and returns the logits rows asked for."""

    def __init__(self, model, vocab: int, *, n_ctx: int, n_seq_max: int, unified: bool = True, flash: int = 1,
                 threads: int = 2):
        L = self._L = llama_library()
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 1024, 512, n_seq_max
        cp.kv_unified, cp.flash_attn_type = unified, flash
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx, self.vocab = L.llama_init_from_model(model, cp), vocab
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(1024, 0, 1)

    def decode(self, entries) -> np.ndarray:
        L, b = self._L, self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, wants) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wants
            b.seq_id[i][0] = seq
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError(f"llama_decode failed on {len(entries)} tokens")
        rows = sum(e[3] for e in entries)
        return np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(rows, self.vocab)).copy()

    def close(self) -> None:
        self._L.llama_batch_free(self.batch)
        self._L.llama_free(self.ctx)
