"""Structured-output workloads in both benchmarks: entries carrying response_format /
structured_outputs / tools / tool_choice / schema, each answer judged with jsonschema, the
grammar's forced-token counts in the reports; and one short real run of each command on
engines/smollm2-135m-ggml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtssd.bench.prompts import PromptItem, load_prompt_set
from trtssd.bench.records import RequestRecord, RunKey, RunResult, grammar_summary
from trtssd.bench.runners import SkipRun, llamacpp_schema
from trtssd.bench.serve import RequestResult, ServeConfig, _apply_event, request_body, spec_summary, summarize_run
from trtssd.bench.serve_report import structured_lines
from trtssd.bench.structured_runs import judge_run, structured_sets
from trtssd.bench.workload import judge, parse_structured
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.structured.constraint import Constraint

ROOT = Path(__file__).resolve().parents[1]
DOCS_WORKLOAD = ROOT / "docs/bench/structured-outputs-vs-llama-server/workload.json"
GGML_ENGINE = ROOT / "engines/smollm2-135m-ggml"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# --- entries -------------------------------------------------------------------------------------


def test_the_built_in_set_is_the_docs_workload_and_two_tool_calls():
    items = load_prompt_set("json-schemas")
    docs = json.loads(DOCS_WORKLOAD.read_text())
    assert [(it.text, it.structured.schema()) for it in items[:8]] == [(e["prompt"], e["schema"]) for e in docs]
    tools = items[8:]
    assert len(tools) == 2 and all(it.structured.forces_call for it in tools)
    assert load_prompt_set(str(DOCS_WORKLOAD), 3)[2].structured.schema() == docs[2]["schema"]  # a .json list


def test_schema_shorthand_is_a_json_schema_response_format():
    fields = parse_structured({"prompt": "p", "schema": PERSON}, "x:1")
    assert fields.body == {"response_format": {"type": "json_schema", "json_schema": {"name": "answer",
                                                                                     "schema": PERSON}}}
    assert fields.constraint() == Constraint.json_schema(PERSON)
    assert parse_structured({"prompt": "p"}, "x:1") is None
    assert parse_structured({"prompt": "p", "structured_outputs": {"choice": ["a", "b"]}},
                            "x:1").constraint() == Constraint.choice(["a", "b"])


@pytest.mark.parametrize("rec, match", [
    ({"schema": PERSON, "response_format": {"type": "json_object"}}, "'schema' or 'response_format'"),
    ({"response_format": {"type": "yaml"}}, "json_schema, json_object, text"),
    ({"structured_outputs": {"json": PERSON, "regex": "a"}}, "exactly one of json, regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of 'tools'"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "none, auto, required"),
    ({"tools": [WEATHER], "tool_choice": "required", "schema": PERSON}, "one constraint per request"),
    ({"tools": [{"type": "function"}]}, r"'tools\[0\]'"),
])
def test_bad_entries_name_the_field_and_line(tmp_path, rec, match):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "p", **rec}) + "\n")
    with pytest.raises(ValueError, match=match) as err:
        load_prompt_set(str(path))
    assert f"{path}:1" in str(err.value)


def test_answers_are_judged_against_schema_and_tool_parameters():
    schema = parse_structured({"schema": PERSON}, "x")
    assert judge(schema, '{"name": "Ann", "age": 3}', []).valid is True
    assert judge(schema, '{"name": "Ann"}', []).reason.startswith("schema:")
    assert "not JSON" in judge(schema, '{"name": ', []).reason
    tools = parse_structured({"tools": [WEATHER], "tool_choice": "required"}, "x")
    assert judge(tools, "", [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]).valid is True
    assert judge(tools, "", [{"name": "get_weather", "arguments": '{"town": "Oslo"}'}]).valid is False
    assert judge(tools, "sunny", []).reason == "no tool call"
    auto = parse_structured({"tools": [WEATHER]}, "x")
    assert judge(auto, "sunny", []).valid is None  # a text answer to "auto": nothing to check
    assert judge(parse_structured({"structured_outputs": {"regex": "[0-9]+"}}, "x"), "42", []).valid is True


# --- bench serve ---------------------------------------------------------------------------------


def test_serve_bodies_carry_the_fields_without_ignore_eos():
    cfg = ServeConfig(endpoint="/v1/chat/completions", ignore_eos=True)
    schema_item, plain = PromptItem("d", "a", "p", structured=parse_structured({"schema": PERSON}, "x")), \
        PromptItem("d", "b", "p")
    body = request_body(schema_item, cfg, "m")
    assert body["response_format"]["json_schema"]["schema"] == PERSON and "ignore_eos" not in body
    assert request_body(plain, cfg, "m")["ignore_eos"] is True
    tools_item = PromptItem("d", "c", "p", structured=parse_structured({"tools": [WEATHER]}, "x"))
    assert request_body(tools_item, cfg, "m")["tools"] == [WEATHER]
    with pytest.raises(ValueError, match="--endpoint /v1/chat/completions"):
        request_body(tools_item, ServeConfig(), "m")


def _streamed(deltas: list[dict]) -> RequestResult:
    result = RequestResult("d/a", e2e_s=1.0)
    for i, delta in enumerate(deltas):
        _apply_event({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}, result, 0.1 * i, chat=True)
    return result


def test_streamed_tool_calls_are_joined_and_judged():
    tools = parse_structured({"tools": [WEATHER], "tool_choice": "required"}, "x")
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}
    rest = {"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}
    good = _streamed([{"role": "assistant"}, {"tool_calls": [call]}, {"tool_calls": [rest]}])
    good.judge(tools)
    assert good.tool_calls == {0: {"name": "get_weather", "arguments": '{"city": "Oslo"}'}} and good.verdict.valid
    bad = _streamed([{"role": "assistant"}, {"content": '{"name": 1}'}])
    bad.judge(parse_structured({"schema": PERSON}, "x"))
    assert bad.verdict.valid is False and bad.to_dict()["valid"] is False
    summary = summarize_run([good, bad], 1.0, (99.0,))
    assert (summary["structured"]["checked"], summary["structured"]["valid"]) == (2, 1)


def test_forced_token_counters_and_report_table():
    before = {"forced_tokens": 10.0, "forced_accepted_tokens": 8.0, "mask_seconds": 0.01, "forced_rounds": 4.0}
    after = {"forced_tokens": 30.0, "forced_accepted_tokens": 23.0, "mask_seconds": 0.03, "forced_rounds": 9.0}
    spec = spec_summary(before, after)
    assert spec["forced_acceptance_rate"] == 0.75 and spec["forced_rounds"] == 5.0
    run = {"name": "c=1", "spec": spec, "summary": {"total_output_tokens": 40,
                                                   "structured": {"checked": 2, "valid": 2, "invalid_reasons": {}}}}
    table = "\n".join(structured_lines([run]))
    assert "| c=1 | 2 / 2 | 5 | 20 | 0.50 | 0.75 | 0.500 |" in table
    assert structured_lines([{"name": "c=1", "spec": None, "summary": {}}]) == []


# --- offline bench -------------------------------------------------------------------------------


class _Tokenizer:
    """Decodes ids as characters; its chat template renders no tools."""

    chat_template = "{{ messages }}"

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_offline_sets_constrain_each_prompt_and_leave_out_tools_the_model_cannot_take():
    items = {"json-schemas": load_prompt_set("json-schemas"), "chat": [PromptItem("chat", "c", "hi")]}
    kept, sets, notes = structured_sets(items, _Tokenizer())
    assert len(kept["json-schemas"]) == 8 and "chat" not in sets
    assert all(c.kind == "json_schema" for c in sets["json-schemas"].constraints)
    assert any("2 tool-call prompts left out" in n for n in notes)
    ids = [ord(c) for c in '{"name": "Ann", "age": 3}']
    records = [RequestRecord(it.id, 5, tuple(ids), "stop", 0.1, 0.2, ()) for it in kept["json-schemas"][:2]]
    run = judge_run(RunResult(RunKey("ar", "json-schemas", 1, 0.0), {}, records), sets["json-schemas"], _Tokenizer())
    assert run.summary["structured"]["checked"] == 2 and run.requests[0].valid is True  # schema-1 is a person
    assert run.requests[1].valid is False  # schema-2 asks for a sentiment


def test_grammar_fields_and_the_llamacpp_peer():
    spec = SpeculationMetrics(grammar_rounds=3, grammar_proposed_tokens=12, grammar_accepted_tokens=9,
                              grammar_mask_time_s=0.002)
    g = grammar_summary(spec, 30)
    assert (g["grammar_rounds"], g["forced_acceptance_rate"], g["forced_share"]) == (3, 0.75, 0.3)
    assert grammar_summary(SpeculationMetrics(), 30) is None
    assert llamacpp_schema(Constraint.json_schema(PERSON)) == PERSON
    assert llamacpp_schema(Constraint.json_object()) == {"type": "object"}
    with pytest.raises(SkipRun, match="JSON schemas only"):
        llamacpp_schema(Constraint.regex("[0-9]+"))


# --- real runs on the ggml engine ----------------------------------------------------------------


def _workload(tmp_path: Path, n: int) -> str:
    path = tmp_path / "w.jsonl"
    entries = json.loads(DOCS_WORKLOAD.read_text())[:n]
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return str(path)


@pytest.mark.slow
@pytest.mark.skipif(not GGML_ENGINE.is_dir(), reason="needs engines/smollm2-135m-ggml")
def test_bench_serve_on_the_ggml_engine(tmp_path):
    from trtssd import LLM
    from trtssd.bench.serve import Load, run_serve_benchmark
    from trtssd.serving.openai_server import OpenAIServer
    from trtssd.serving.uvicorn_runner import BackgroundServer

    with LLM(str(GGML_ENGINE), mode="ar", max_batch=1, max_model_len=512) as llm:
        with BackgroundServer(OpenAIServer(llm, "smol")) as bg:
            cfg = ServeConfig(base_url=bg.url, endpoint="/v1/chat/completions", datasets=(_workload(tmp_path, 2),),
                              num_prompts=2, max_tokens=48, loads=(Load(1),), out_dir=tmp_path / "out", plots=False,
                              ignore_eos=True)
            report = run_serve_benchmark(cfg)
    summary = report.runs[0].summary
    assert summary["completed"] == 2 and summary["structured"]["checked"] == 2
    assert report.runs[0].spec is not None
    assert all(r.verdict is not None for r in report.runs[0].requests)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(not GGML_ENGINE.is_dir(), reason="needs engines/smollm2-135m-ggml")
def test_bench_on_the_ggml_engine(tmp_path):
    from trtssd.bench.cli import main

    out = tmp_path / "out"
    assert main(["--engine", str(GGML_ENGINE), "--systems", "ar,sd", "--datasets", _workload(tmp_path, 2),
                 "--prompts", "2", "--max-tokens", "48", "--no-calibrate", "--no-plots", "--no-warmup",
                 "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    runs = {r["key"]["system"]: r for r in data["runs"]}
    for system in ("ar", "sd"):
        assert runs[system]["error"] is None and runs[system]["summary"]["structured"]["checked"] == 2
    assert "grammar" in runs["sd"]["summary"]  # the grammar's forced proposals, SpeculationMetrics.grammar_*
    assert "## Structured outputs" in (out / "results.md").read_text()
