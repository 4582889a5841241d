"""Engine directories on a tiny GGUF model: build, no-op rebuild, load, tokenizer identity."""

from __future__ import annotations

import dataclasses
import json
import logging

import gguf
import pytest
import torch

import trtssd.build as build_module
import trtssd.models.catalog as catalog
from trtssd import LLM
from trtssd.backends.base import chain_chunk
from trtssd.backends.loading import load_engine, load_side
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.build import TokenizerMismatchError, build_engine, gguf_tokenizer_fields, resolve_recipe
from trtssd.config import speculative_config
from trtssd.hashing import file_sha256
from trtssd.models.catalog import NamedEngine
from trtssd.models.engine_dir import DRAFT_FILE, DRAFT_GGUF, MANIFEST, TARGET_FILE, engine_speculation, load_manifest
from tiny_models import make_tiny_gguf, make_tiny_llama

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    source = make_tiny_gguf(root / "Tiny-Model.gguf")
    engine = build_engine(source, root / "engines", progress=False)
    return source, engine


def test_engine_layout_and_manifest(built):
    source, engine = built
    assert engine.name == "tiny-model"
    assert (engine / TARGET_FILE).read_bytes() == source.read_bytes()
    manifest = load_manifest(engine)
    assert manifest["architecture"]["num_layers"] == 2 and manifest["architecture"]["tie_word_embeddings"]
    assert manifest["target"]["backend"] == "torch" and manifest["draft"]["backend"] == "torch-int4"
    # 2 layers x 4 projections are Q4_1 in the file; the tied Q8_0 output layer is re-quantized.
    assert manifest["draft"]["projections_exact_from_q4_1"] == 8
    assert manifest["draft"]["projections_requantized"] == ["lm_head"]
    assert manifest["tokenizer"]["vocab_size"] == 261 and manifest["tokenizer"]["num_merges"] == 4
    assert set(manifest["build"]["outputs"]) == {TARGET_FILE, DRAFT_FILE}
    assert "draft_layers.cpp" in manifest["draft"]["execution"]


def test_rebuild_is_a_noop_unless_inputs_change(built, caplog):
    source, engine = built
    before = (engine / MANIFEST).stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="trtssd.build"):
        assert build_engine(source, engine.parent, progress=False) == engine
    assert "up to date" in caplog.text
    assert (engine / MANIFEST).stat().st_mtime_ns == before
    # A damaged output is noticed and rebuilt.
    draft = engine / DRAFT_FILE
    good = draft.read_bytes()
    draft.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    build_engine(source, engine.parent, progress=False)
    assert (engine / MANIFEST).stat().st_mtime_ns != before
    assert draft.read_bytes() == good
    assert json.loads((engine / MANIFEST).read_text())["build"]["outputs"][DRAFT_FILE] == file_sha256(draft)
    assert not [p for p in engine.parent.iterdir() if ".build-" in p.name]  # no staging left behind


def test_loaded_draft_agrees_with_target(built):
    _, engine = built
    loaded = load_engine(engine, max_seqs=1, max_seq_len=64)
    prompt = loaded.tokenizer.encode(" the cat in a hat")
    assert prompt[0] == 257  # the merge "Ġ t" (ids: 0 special, 1..256 bytes, then merges)
    logits = []
    for ex in (loaded.target, loaded.draft):
        ex.add_sequence(0)
        logits.append(ex.forward([chain_chunk(0, prompt, 0)])[0])
    target, draft = logits
    assert draft.shape == target.shape == (len(prompt), 261)
    # Same Q4_1 projections; bf16 arithmetic and the re-quantized output layer differ, but the
    # head's best 16 rows are re-scored in fp32, so the top of the distribution matches closely.
    assert (draft.argmax(-1) == target.argmax(-1)).all()
    top = target.topk(4, dim=-1).indices
    assert (draft.gather(1, top) - target.gather(1, top)).abs().max() < 0.02 * target.abs().max()


def test_draft_loads_with_compiled_layers_unless_asked_not_to(built):
    _, engine = built
    assert load_side(engine, "draft", max_seqs=1, max_seq_len=64).model.fused_layers is not None
    assert load_side(engine, "draft", max_seqs=1, max_seq_len=64, fused=False).model.fused_layers is None


def test_tokenizer_mismatch_is_refused(built, tmp_path):
    source, _ = built
    # Same vocabulary, merges in another order: tokenizes differently, so it must be refused.
    other = make_tiny_gguf(tmp_path / "other.gguf", merges=["Ġ a", "Ġ t", "i n", "h e"])
    with pytest.raises(TokenizerMismatchError, match=r"tokenizer\.ggml\.merges.*index 0: 'Ġ t' vs 'Ġ a'"):
        build_engine(source, tmp_path / "engines", draft=other, progress=False)
    assert not (tmp_path / "engines" / "tiny-model").exists()


def test_tokenizer_fields_read_as_the_gguf_package_reads_them(built):
    """Our header walk (the one GGUF reader) against the gguf package's reader."""
    source, _ = built
    fields = gguf.GGUFReader(source).fields
    ours = gguf_tokenizer_fields(source)
    assert len(ours["tokenizer.ggml.tokens"]) == 261 and len(ours["tokenizer.ggml.merges"]) == 4
    for key, value in ours.items():
        expected = fields[key].contents()
        assert value == (list(expected) if isinstance(expected, (list, tuple)) else expected), key


def test_bad_references(tmp_path):
    with pytest.raises(ValueError, match="unknown engine name 'no-such-model'"):
        resolve_recipe("no-such-model")
    with pytest.raises(ValueError, match="Hugging Face directory"):
        resolve_recipe(tmp_path)
    with pytest.raises(FileNotFoundError):
        resolve_recipe(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="head_top_k"):
        resolve_recipe(make_tiny_gguf(tmp_path / "t.gguf", layers=1), head_top_k=-1)


def test_stored_draft_groups_decode_to_the_target_weights(built):
    """Q4_1 projections are stored without loss: decoding them gives the target's fp32 weights
    bit for bit (the same dequantization the target loader performs)."""
    from safetensors.torch import load_file

    from trtssd.models.loader import gguf_config, gguf_state_dict, read_gguf
    from trtssd.models.quant import Int4Groups, unpack_nibbles

    source, engine = built
    g = read_gguf(source)
    target = gguf_state_dict(g, gguf_config(g))
    stored = load_file(str(engine / DRAFT_FILE))
    for i in range(2):
        for part in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"):
            name = f"layers.{i}.{part}"
            groups = Int4Groups(unpack_nibbles(stored[f"int4.{name}.codes"]),
                                stored[f"int4.{name}.scales"].float(), stored[f"int4.{name}.mins"].float())
            assert torch.equal(groups.dequantize(), target[f"{name}.weight"]), name
    assert torch.equal(stored["param.embed.weight"], target["embed.weight"])


def test_concurrent_builds_build_once(tmp_path, caplog):
    from concurrent.futures import ThreadPoolExecutor

    source = make_tiny_gguf(tmp_path / "c.gguf", layers=1)
    with caplog.at_level(logging.INFO, logger="trtssd.build"), ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: build_engine(source, tmp_path / "engines", progress=False), range(2)))
    assert paths[0] == paths[1] and (paths[0] / MANIFEST).is_file()
    assert caplog.text.count("building engine") == 1  # the other call waited, then found it built


# -- a separate draft model ---------------------------------------------------------------------


def _first_logits(executor, prompt: list[int]) -> torch.Tensor:
    executor.add_sequence(0)
    try:
        return executor.forward([chain_chunk(0, prompt, 0)])[0]
    finally:
        executor.release(0)


def test_separate_gguf_draft_runs_its_own_weights(tmp_path):
    target = make_tiny_gguf(tmp_path / "t.gguf", seed=0)
    other = make_tiny_gguf(tmp_path / "d.gguf", seed=1, layers=1)
    engine = build_engine(target, tmp_path / "engines", draft=other, name="pair", plain_weights=False, progress=False)
    manifest = load_manifest(engine)
    draft = manifest["draft"]
    assert (draft["backend"], draft["path"], draft["dtype"], draft["plain_weights"]) == ("torch", DRAFT_GGUF, "float32", False)
    assert draft["config"]["num_layers"] == 1 and manifest["target"]["plain_weights"] is False
    assert set(manifest["build"]["outputs"]) == {TARGET_FILE, DRAFT_GGUF}
    prompt = list(range(3, 12))
    ours = _first_logits(load_side(engine, "draft", max_seqs=1, max_seq_len=64), prompt)
    direct = _first_logits(TorchExecutor.from_pretrained(other, max_seqs=1, max_seq_len=64), prompt)
    assert torch.allclose(ours, direct, atol=1e-5, rtol=0)


def test_hugging_face_pair(tmp_path):
    target = make_tiny_llama(tmp_path / "t", seed=0)
    other = make_tiny_llama(tmp_path / "d", seed=1, layers=1)
    engine = build_engine(target, tmp_path / "engines", draft=other, progress=False)
    manifest = load_manifest(engine)
    assert engine.name == "t" and manifest["tokenizer"] is None  # tiny models have no tokenizer
    assert (manifest["target"]["path"], manifest["target"]["format"]) == ("target", "huggingface")
    assert (manifest["draft"]["path"], manifest["draft"]["backend"]) == ("draft", "torch")
    prompt = list(range(3, 12))
    for side, source in (("target", target), ("draft", other)):
        ours = _first_logits(load_side(engine, side, max_seqs=1, max_seq_len=64), prompt)
        direct = _first_logits(TorchExecutor.from_pretrained(source, max_seqs=1, max_seq_len=64), prompt)
        assert torch.equal(ours, direct), side
    with pytest.raises(ValueError, match="int4 draft is made from a GGUF"):
        resolve_recipe(target)  # the self-draft default needs GGUF weights


def test_pairs_with_different_vocabularies_are_refused(tmp_path):
    target = make_tiny_llama(tmp_path / "t", seed=0)
    wider = make_tiny_llama(tmp_path / "w", seed=1, vocab=80)
    with pytest.raises(TokenizerMismatchError, match="64 vocabulary rows, draft .* 80"):
        build_engine(target, tmp_path / "engines", draft=wider, progress=False)
    gguf_target = make_tiny_gguf(tmp_path / "g.gguf")  # has a tokenizer; the Hugging Face draft has none
    with pytest.raises(TokenizerMismatchError, match="differ in model.type"):
        build_engine(gguf_target, tmp_path / "engines", draft=target, progress=False)
    assert not [p for p in (tmp_path / "engines").iterdir() if not p.name.startswith(".")]


def test_named_engines_are_listed_when_a_name_is_unknown():
    with pytest.raises(ValueError, match="'smollm2-135m', 'qwen2.5-coder-1.5b'"):
        resolve_recipe("qwen-unknown")


def test_a_named_engine_carries_its_tuned_speculation_defaults(tmp_path, monkeypatch):
    """The manifest records the pair's tuned K / fan-out budget; LLM applies them where its caller
    sets nothing, the caller's options win, and another draft does not inherit them."""
    source = make_tiny_gguf(tmp_path / "Tiny-Model.gguf")
    tuned = NamedEngine("tiny-tuned", "test", target=lambda: source, speculation={"torch": {"k": 3, "fanout_budget": 6}})
    monkeypatch.setitem(catalog.NAMED_ENGINES, "tiny-tuned", tuned)
    monkeypatch.setattr(build_module, "NAMED_ENGINES", catalog.NAMED_ENGINES)
    engine = build_engine("tiny-tuned", tmp_path / "engines", progress=False)
    assert load_manifest(engine)["speculation"] == {"k": 3, "fanout_budget": 6}
    assert engine_speculation(engine) == {"k": 3, "fanout_budget": 6}
    with LLM(str(engine), launch="local", mode="sd") as llm:
        assert (llm.spec.k, llm.spec.fanout_budget) == (3, 6)
    with LLM(str(engine), launch="local", mode="sd", k=4) as llm:
        assert (llm.spec.k, llm.spec.fanout_budget) == (4, 6)
    other = build_engine("tiny-tuned", tmp_path / "engines", draft=source, name="tiny-other", progress=False)
    assert load_manifest(other)["speculation"] == {} and engine_speculation(source) == {}
    monkeypatch.setitem(catalog.NAMED_ENGINES, "tiny-tuned", dataclasses.replace(tuned, speculation={"torch": {"k": 0}}))
    with pytest.raises(ValueError, match="k must be an integer in"):
        build_engine("tiny-tuned", tmp_path / "engines", progress=False)


def test_speculation_options_merge_over_engine_defaults():
    assert speculative_config({}, {"k": 3}).k == 3
    assert speculative_config({"k": 7}, {"k": 3}).k == 7
    # A fanout given alone fixes K (here 2), whatever the engine's K.
    assert speculative_config({"fanout": (1, 1, 1)}, {"k": 6}).fixed_fanout == (1, 1, 1)
    with pytest.raises(ValueError, match=r"engines/x/manifest.json: unknown speculation setting\(s\) \['depth'\]"):
        speculative_config({}, {"depth": 3}, defaults_from="engines/x/manifest.json")
    with pytest.raises(ValueError, match="fanout_budget must be an integer in"):
        speculative_config({"fanout_budget": 0}, {"k": 3})
    with pytest.raises(ValueError, match="fanout must be 'auto' or a list of k\\+1"):
        speculative_config({"fanout": (1,)}, {"k": 3})
