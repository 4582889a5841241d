"""Structured outputs through the runtime, on real models: greedy output under a constraint equals
constrained plain decoding in ar, sd and ssd on every path (hits, both backups, plain rounds that
verify the grammar's forced tokens), on the ggml and torch executors; every output validates
against its schema; a document that cannot end within max_tokens ends with "length"."""

from __future__ import annotations

import json

import jsonschema
import pytest

from json_schemas import SCHEMAS
from trtssd import LLM, Constraint, SamplingParams
from trtssd.models.tokenizer import chat_prompt_ids
from trtssd.sampling import FieldError

GREEDY_CASES = SCHEMAS[:4]


def _prompt(llm: LLM, text: str, schema: dict) -> list[int]:
    ask = f"{text} Answer in JSON matching this schema: {json.dumps(schema)}"
    return chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": ask}])


def _run(engine, mode: str, cases, params_of, plain_rounds: bool = False, **options):
    """Token ids, texts and finish reasons of ``cases`` generated in one batch, and the metrics."""
    with LLM(str(engine), mode=mode, max_batch=4, max_model_len=1024, launch="local", **options) as llm:
        if plain_rounds:  # every round plain: the grammar's forced tokens are its only proposals
            llm.loop.policy.speculate = lambda rows: False
        prompts = [_prompt(llm, text, schema) for text, schema in cases]
        outs = llm.generate(prompts, [params_of(schema) for _, schema in cases])
        return [o.token_ids for o in outs], [o.text for o in outs], [o.finish_reason for o in outs], llm.metrics.summary()


def _greedy(schema: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=120, constraint=Constraint.json_schema(schema))


PATHS = {
    "sd": ("sd", {"plain_under_load": False}, False),
    "ssd-neural": ("ssd", {"backup": "neural", "plain_under_load": False}, False),
    "ssd-fast": ("ssd", {"backup": "fast", "plain_under_load": False}, False),
    "ssd-plain-rounds": ("ssd", {}, True),
}


def _check_greedy_paths(engine) -> None:
    reference, texts, reasons, _ = _run(engine, "ar", GREEDY_CASES, _greedy)
    for text, reason, (_, schema) in zip(texts, reasons, GREEDY_CASES):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    seen = {}
    for name, (mode, options, plain_rounds) in PATHS.items():
        ids, _, _, summary = _run(engine, mode, GREEDY_CASES, _greedy, plain_rounds, **options)
        assert ids == reference, name
        seen[name] = summary
    assert seen["sd"]["mean_acceptance_length"] > 1.5
    assert seen["ssd-neural"]["cache_hits"] > 0 and seen["ssd-neural"]["neural_backups"] > 0
    assert seen["ssd-fast"]["fast_backups"] > 0
    forced = seen["ssd-plain-rounds"]
    assert forced["grammar_rounds"] > 0 and forced["grammar_accepted_tokens"] > 0


@pytest.mark.slow
def test_greedy_constrained_equals_ar_on_every_path_on_ggml(ggml_smollm2):
    _check_greedy_paths(ggml_smollm2)


@pytest.mark.slow
def test_greedy_constrained_equals_ar_on_every_path_on_torch():
    from trtssd.build import default_engine

    _check_greedy_paths(default_engine())


def _valid_outputs(engine, mode: str, params_of, **options) -> dict:
    _, texts, reasons, summary = _run(engine, mode, SCHEMAS, params_of, **options)
    for text, reason, (ask, schema) in zip(texts, reasons, SCHEMAS):
        assert reason == "stop", (ask, text)
        jsonschema.validate(json.loads(text), schema)
    return summary


@pytest.mark.slow
def test_every_sampled_output_validates_on_the_default_engine():
    """The default engine in its default mode, sampled (seeded): 22 schemas, all valid."""
    from trtssd.build import default_engine

    def sampled(schema: dict) -> SamplingParams:
        return SamplingParams(temperature=0.8, seed=7, max_tokens=200, constraint=Constraint.json_schema(schema))

    _valid_outputs(default_engine(), "ssd", sampled)


@pytest.mark.slow
def test_every_output_validates_on_the_qwen_pair(qwen_ggml):
    summary = _valid_outputs(qwen_ggml, "ssd", lambda s: SamplingParams(
        temperature=0, max_tokens=200, constraint=Constraint.json_schema(s)))
    assert summary["num_generated_tokens"] > 0


@pytest.mark.slow
def test_a_document_cut_by_max_tokens_ends_with_length(ggml_smollm2):
    _, texts, reasons, _ = _run(ggml_smollm2, "ssd", SCHEMAS[:2], lambda s: SamplingParams(
        temperature=0, max_tokens=3, constraint=Constraint.json_schema(s)))
    assert reasons == ["length", "length"]


@pytest.mark.slow
def test_regex_choice_and_grammar_constraints(ggml_smollm2):
    cases = [
        (Constraint.regex(r"[0-9]{3}-[0-9]{4}"), lambda t: len(t) == 8 and t[3] == "-"),
        (Constraint.choice(["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (Constraint.grammar('root ::= "yes" | "no" | "maybe " [a-z]+'), lambda t: t in ("yes", "no") or t.startswith("maybe ")),
        (Constraint.json_object(), lambda t: isinstance(json.loads(t), dict)),
    ]
    with LLM(str(ggml_smollm2), mode="ssd", max_batch=4, max_model_len=512, launch="local") as llm:
        outs = llm.generate(["Pick one: red, green or blue."] * len(cases),
                            [SamplingParams(temperature=0, max_tokens=40, constraint=c) for c, _ in cases])
        for (c, ok), out in zip(cases, outs):
            assert out.finish_reason == "stop" and ok(out.text), (c, out.text)


@pytest.mark.slow
def test_bad_constraints_are_refused_at_admission_naming_the_field(ggml_smollm2):
    with LLM(str(ggml_smollm2), mode="ar", max_batch=2, max_model_len=256, launch="local") as llm:
        for bad in (Constraint.json_schema({"type": "objekt"}), Constraint.regex("(unclosed"),
                    Constraint.grammar("root ::= undefined_rule")):
            with pytest.raises(FieldError) as err:
                llm.generate(["hi"], SamplingParams(constraint=bad))
            assert err.value.field == "constraint" and bad.kind in str(err.value)
        assert llm.generate(["hi"], SamplingParams(max_tokens=2))[0].token_ids  # still serving


@pytest.fixture(scope="module")
def ggml_smollm2():
    from trtssd.build import build_engine

    return build_engine("smollm2-135m", backend="ggml", progress=False)


@pytest.fixture(scope="module")
def qwen_ggml():
    from trtssd.build import build_engine

    return build_engine("qwen2.5-coder-1.5b", backend="ggml", progress=False)
