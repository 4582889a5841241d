"""The engine options of the command line (trtssd/cli_options.py): one per field of
SpeculativeConfig and RuntimeConfig, declared alike on every command that starts an engine, read
back as the keywords LLM takes, and bad values said as usage errors naming the option."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import shlex

import pytest

from trtssd import cli
from trtssd.bench import cli as bench_cli
from trtssd.bench import runners
from trtssd.cli_options import ENGINE_FIELDS, engine_options, flag
from trtssd.config import RuntimeConfig, SpeculativeConfig

# Every command that starts an engine, with the arguments it needs to parse.
COMMANDS = {"generate": ["generate"], "serve": ["serve"], "triton-repo": ["triton-repo", "--out", "repo"]}

# A value for every field, none of them its default: (the command line's words, the value LLM gets).
GIVEN = {
    "mode": (["--mode", "sd"], "sd"), "k": (["--k", "3"], 3), "fanout": (["--fanout", "1,2,1,1"], (1, 2, 1, 1)),
    "fanout_budget": (["--fanout-budget", "4"], 4), "saguaro_c": (["--saguaro-c", "0.5"], 0.5),
    "backup": (["--backup", "neural"], "neural"), "draft_timeout_s": (["--draft-timeout-s", "5"], 5.0),
    "plain_under_load": (["--no-plain-under-load"], False), "k_per_round": (["--k-per-round"], True),
    "max_batch": (["--max-batch", "2"], 2), "prefix_cache_seqs": (["--prefix-cache-seqs", "0"], 0),
    "prefix_cache_mib": (["--prefix-cache-mib", "64"], 64),
    "prefill_chunk": (["--prefill-chunk", "512"], 512),
    "max_model_len": (["--max-model-len", "256"], 256), "tensor_parallel_size": (["--tensor-parallel-size", "2"], 2),
    "target_threads": (["--target-threads", "2"], 2),
    "draft_threads": (["--draft-threads", "3"], 3), "target_cores": (["--target-cores", "0,1"], (0, 1)),
    "draft_cores": (["--draft-cores", "2"], (2,)), "poll_interval_s": (["--poll-interval-s", "0.001"], 0.001),
    "lend_draft_cores": (["--lend-draft-cores", "always"], "always"),
    "row_invariant": (["--no-row-invariant"], False),
    "target_device": (["--target-device", "cuda:1"], "cuda:1"), "draft_device": (["--draft-device", "cuda"], "cuda"),
    "transport": (["--transport", "cuda_ipc"], "cuda_ipc"),
    "verifier": (["--verifier", "trtllm"], "trtllm"),
    "trtllm_engine_dir": (["--trtllm-engine-dir", "/engines/t.trtllm"], "/engines/t.trtllm"),
}


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _engine_actions(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """How a parser declares each engine option: what a user sees and what it parses to."""
    return {a.dest: (tuple(a.option_strings), a.choices, a.type, a.help, a.default)
            for a in parser._actions if a.dest in ENGINE_FIELDS}


def _words(names) -> list[str]:
    return [word for name in names for word in GIVEN[name][0]]


def test_every_config_field_has_a_value_here():
    assert set(GIVEN) == set(ENGINE_FIELDS)  # a new field: give it a value above


@pytest.mark.parametrize("command", COMMANDS)
def test_every_config_field_is_an_option_of_each_command_that_starts_an_engine(command):
    declared = _engine_actions(_subparser(command))
    assert list(declared) == list(ENGINE_FIELDS)
    assert all(options == (flag(name),) or options == (flag(name), flag(name).replace("--", "--no-", 1))
               for name, (options, *_) in declared.items())


def test_the_commands_declare_the_same_options_and_bench_those_it_does_not_sweep():
    declared = [_engine_actions(_subparser(command)) for command in COMMANDS]
    assert all(d == declared[0] for d in declared)
    bench = bench_cli.build_parser()
    generated = bench.parse_args([]).engine_fields  # bench's --k and --budget are its own: sweeps
    assert set(generated) == set(ENGINE_FIELDS) - set(bench_cli.SWEPT)
    assert all(_engine_actions(bench)[name] == declared[0][name] for name in generated)


@pytest.mark.parametrize("command", COMMANDS)
def test_command_line_to_llm_keywords_round_trip(command):
    args = cli.build_parser().parse_args(COMMANDS[command] + _words(ENGINE_FIELDS))
    options = engine_options(args)
    assert options == {name: value for name, (_, value) in GIVEN.items()}
    # LLM splits its keywords by the configs' fields; each config then holds what was given.
    for cls in (SpeculativeConfig, RuntimeConfig):
        config = cls(**{k: v for k, v in options.items() if k in cls.__dataclass_fields__})
        for f in dataclasses.fields(cls):
            held = getattr(config, f.name)
            assert (held.value if isinstance(held, enum.Enum) else held) == GIVEN[f.name][1]
    assert engine_options(cli.build_parser().parse_args(COMMANDS[command])) == {}  # unset: LLM's defaults


def test_bench_passes_every_option_it_does_not_sweep_to_its_llms(monkeypatch):
    seen = []
    monkeypatch.setattr("trtssd.llm.LLM", lambda *args, **options: seen.append(options))
    names = [name for name in ENGINE_FIELDS if name not in bench_cli.SWEPT]
    words = _words(names) + ["--target", "t", "--k", "3,5", "--budget", "6,12"]
    cfg = bench_cli.config_from_args(bench_cli.build_parser().parse_args(words))
    assert (cfg.ks, cfg.budgets) == ((3, 5), (6, 12))
    runners.TrtssdRunner(cfg, "ssd", 3, 6, 256)
    assert {name: seen[0][name] for name in names} == {name: GIVEN[name][1] for name in names}
    assert (seen[0]["mode"], seen[0]["k"], seen[0]["fanout_budget"], seen[0]["max_model_len"]) == ("ssd", 3, 6, 256)
    defaults = bench_cli.config_from_args(bench_cli.build_parser().parse_args([]))
    assert (defaults.backup, defaults.lend_draft_cores, defaults.target_device, defaults.llm_options) == \
        ("auto", "exact", "cpu", {})


@pytest.mark.parametrize("command", COMMANDS)
def test_a_renamed_option_keeps_its_old_flag_for_one_release(command):
    """--max-seq-len (the old name of --max-model-len) still sets max_model_len, with a
    FutureWarning; both at once is a usage error naming both."""
    parse = lambda *words: engine_options(_subparser(command).parse_args([*COMMANDS[command][1:], *words]))  # noqa: E731
    with pytest.warns(FutureWarning, match="max_seq_len is deprecated: use max_model_len"):
        assert parse("--max-seq-len", "300")["max_model_len"] == 300
    with pytest.raises(ValueError, match="--max-model-len: max_model_len and its deprecated name max_seq_len"):
        parse("--max-model-len", "300", "--max-seq-len", "200")
    assert "deprecated: use --max-model-len" in _subparser(command).format_help()
    # --target-backend torch|trtllm is --verifier executor|trtllm ("torch" also named a ggml target's own).
    with pytest.warns(FutureWarning, match="target_backend is deprecated: use verifier"):
        assert parse("--target-backend", "torch")["verifier"] == "executor"
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="--trtllm-engine-dir: .*verifier 'trtllm'"):
        parse("--target-backend", "trtllm")


def test_a_renamed_option_keeps_its_old_keyword_for_one_release():
    """LLM(max_seq_len=...) is LLM(max_model_len=...) with a FutureWarning, checked under the new
    name before anything loads."""
    from trtssd import LLM

    with pytest.warns(FutureWarning, match="max_seq_len is deprecated"), \
            pytest.raises(ValueError, match="max_model_len must be a positive integer; got 0"):
        LLM(max_seq_len=0)
    with pytest.raises(ValueError, match="max_model_len and its deprecated name max_seq_len were both given"):
        LLM(max_seq_len=64, max_model_len=64)
    from trtssd.config import RuntimeConfig, renamed_options

    with pytest.warns(FutureWarning, match="target_backend is deprecated: use verifier"):
        assert RuntimeConfig(**renamed_options({"target_backend": "torch"})).verifier.value == "executor"


def test_fanout_auto_and_a_fanout_that_fixes_k():
    parse = lambda *words: engine_options(cli.build_parser().parse_args(["generate", *words]))  # noqa: E731
    assert parse("--fanout", "auto") == {"fanout": "auto"}
    assert parse("--fanout", "2,1,1,1,1,1") == {"fanout": (2, 1, 1, 1, 1, 1)}  # K = 5 from its length


@pytest.mark.parametrize("words, said", [
    (["--k", "17"], ["argument --k:", "[1, 16]"]),
    (["--k", "x"], ["argument --k:", "invalid int value"]),
    (["--prefix-cache-seqs", "x"], ["argument --prefix-cache-seqs:", "invalid int value"]),
    (["--prefix-cache-mib", "-1"], ["argument --prefix-cache-mib:", "non-negative integer"]),
    (["--mode", "fast"], ["argument --mode:", "'ar', 'sd', 'ssd'"]),
    (["--transport", "tcp"], ["argument --transport:", "'auto', 'host', 'cuda_ipc'"]),
    (["--lend-draft-cores", "sometimes"], ["argument --lend-draft-cores:", "'exact', 'always', 'never'"]),
    (["--saguaro-c", "0"], ["argument --saguaro-c:", "(0, 1]"]),
    (["--fanout", "1,x"], ["argument --fanout:", "'auto' or comma-separated integers"]),
    (["--k", "3", "--fanout", "1,1"], ["argument --fanout:", "k+1=4"]),
    (["--target-cores", "0,x"], ["argument --target-cores:", "comma-separated integers"]),
    (["--draft-device", "gpu"], ["argument --draft-device:", "'cpu', 'cuda' or 'cuda:N'"]),
    (["--poll-interval-s", "1"], ["argument --poll-interval-s:", "(0, 0.1]"]),
    (["--transport", "cuda_ipc"], ["argument --transport:", "needs draft_device 'cuda' or 'cuda:N'"]),
    (["--verifier", "trtllm"], ["argument --trtllm-engine-dir:", "required with verifier 'trtllm'"]),
])
@pytest.mark.parametrize("command", [*COMMANDS, "bench"])
def test_a_bad_value_is_a_usage_error_naming_its_option(command, words, said, capsys):
    if command == "bench" and words[0] in map(flag, bench_cli.SWEPT):
        pytest.skip("bench sweeps this one with its own option")
    with pytest.raises(SystemExit) as exc:
        cli.main([*COMMANDS.get(command, [command]), *words])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(s in err for s in said), err


@pytest.mark.parametrize("line", [  # as README.md, docs/, scripts/ and the tests write them
    "generate --mode ssd --max-tokens 96 --prompt hi",
    "generate --engine engines/smollm2-135m-ggml --mode ar --launch world",
    "generate --target t --draft d --launch local --max-model-len 128",
    "serve --port 0 --engine e --mode ar --max-batch 4 --served-model-name m --api-key k --launch local",
    "triton-repo --out r --engine e --mode ssd --max-batch 4 --max-model-len 256 --fanout 2,1,1,1,1,1",
    "triton-repo --out r --target-device cuda:1 --draft-device cuda --transport cuda_ipc --instance-kind gpu",
])
def test_documented_command_lines_still_parse(line):
    engine_options(cli.build_parser().parse_args(shlex.split(line)))


@pytest.mark.parametrize("line", [
    "--systems ssd,sd --k 3,5,7 --budget 6,12,24",
    "--engine e --systems ssd --temperature 0.8 --backup neural --saguaro-c 1.0 --no-calibrate --no-plots",
    "--systems ar,llama.cpp --lend-draft-cores always --llamacpp-threads 2 --peer-threads 2",
    "--target-device cuda:0 --draft-device cuda --shared-cores",
])
def test_documented_bench_command_lines_still_parse(line):
    bench_cli.config_from_args(bench_cli.build_parser().parse_args(shlex.split(line)))
