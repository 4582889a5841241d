"""The tiny GGUF models of ggml_models.py load and run in llama.cpp (llama-cpp-python's low-level API)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ggml_models import tiny_gguf_config, tiny_gguf_tensors, write_tiny_gguf

llama_cpp = pytest.importorskip("llama_cpp")

PROMPT = [1, 17, 300, 42, 5, 511, 260, 99, 3, 128]


@pytest.fixture(scope="module")
def quiet_llama():
    """llama.cpp initialised as trtssd does it (its log goes to ``logging``). A callback of this
    module's own would be freed with the module while llama.cpp still calls it."""
    from trtssd.backends.ggml_backend import llama_library

    return llama_library()


def run_prompt(path, tokens) -> tuple[int, np.ndarray]:
    """(vocabulary size, logits of the last prompt token) from one decode of ``tokens``."""
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    assert model, f"llama.cpp could not load {path}"
    try:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = 256
        cparams.n_batch = cparams.n_ubatch = 64
        cparams.n_seq_max = 4
        cparams.kv_unified = True
        cparams.flash_attn_type = 1
        cparams.n_threads = cparams.n_threads_batch = 1
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        assert ctx, "llama.cpp could not create a context"
        try:
            batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
            try:
                batch.n_tokens = len(tokens)
                for i, t in enumerate(tokens):
                    batch.token[i] = t
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = i == len(tokens) - 1
                assert llama_cpp.llama_decode(ctx, batch) == 0
                ptr = llama_cpp.llama_get_logits_ith(ctx, len(tokens) - 1)
                logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).copy()
            finally:
                llama_cpp.llama_batch_free(batch)
        finally:
            llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    return n_vocab, logits


@pytest.mark.parametrize("arch,tensor_type", [("llama", "f32"), ("llama", "q8_0"), ("qwen2", "f32"), ("qwen2", "q8_0")])
def test_tiny_gguf_runs_in_llama_cpp(tmp_path, quiet_llama, arch, tensor_type):
    a = write_tiny_gguf(tmp_path / "a.gguf", arch=arch, tensor_type=tensor_type, seed=0)
    b = write_tiny_gguf(tmp_path / "b.gguf", arch=arch, tensor_type=tensor_type, seed=1)
    n_vocab, logits_a = run_prompt(a, PROMPT)
    _, logits_b = run_prompt(b, PROMPT)
    assert n_vocab == 512 == tiny_gguf_config(arch=arch)["vocab_size"]
    assert np.isfinite(logits_a).all() and np.isfinite(logits_b).all()
    assert np.abs(logits_a).max() > 0
    assert not np.allclose(logits_a, logits_b)
    # The same seed writes the same file.
    assert write_tiny_gguf(tmp_path / "a2.gguf", arch=arch, tensor_type=tensor_type, seed=0).read_bytes() == a.read_bytes()


def test_tiny_gguf_metadata_matches_config(tmp_path):
    import gguf

    from trtssd.models.config import ModelConfig

    kw = dict(arch="qwen2", vocab_size=300, hidden=64, layers=3, heads=4, kv_heads=2, intermediate=96)
    path = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="q8_0", **kw)
    cfg = tiny_gguf_config(**kw)
    reader = gguf.GGUFReader(path)
    fields = {name: reader.fields[name].contents() for name in reader.fields}
    assert fields["general.architecture"] == "qwen2"
    assert fields["qwen2.block_count"] == cfg["num_hidden_layers"] == 3
    assert fields["qwen2.embedding_length"] == cfg["hidden_size"]
    assert fields["qwen2.attention.head_count_kv"] == cfg["num_key_value_heads"]
    assert len(fields["tokenizer.ggml.tokens"]) == cfg["vocab_size"]
    ref = tiny_gguf_tensors(**kw)
    stored = {t.name: t for t in reader.tensors}
    assert stored.keys() == ref.keys() and "blk.2.attn_k.bias" in stored
    for name, values in ref.items():
        t = stored[name]
        assert tuple(int(n) for n in reversed(t.shape)) == values.shape, name  # ggml ne is numpy's shape reversed
        want = gguf.GGMLQuantizationType.Q8_0 if values.ndim == 2 else gguf.GGMLQuantizationType.F32
        assert t.tensor_type == want, name
    q = gguf.quants.dequantize(stored["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_allclose(q, ref["blk.0.attn_q.weight"], atol=1e-3)
    m = ModelConfig.from_hf(cfg)
    assert (m.num_layers, m.num_kv_heads, m.head_dim) == (3, 2, 16)
