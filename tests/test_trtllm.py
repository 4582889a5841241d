"""trtssd.trtllm without TensorRT-LLM: request fields, outcomes, build command lines, the drafter's
bookkeeping, the message when tensorrt_llm is absent, `trtssd build --backend trtllm`, the target
loop's rounds through the TensorRT-LLM verifier (a stand-in executor) and the drafter on a draft
rank of its own."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiny_models import make_tiny_pair
from trtssd import LLM
from trtssd.backends.base import chain_chunk
from trtssd.backends.torch_backend import TorchExecutor
from trtssd.cli import main
from trtssd.config import ModelRef, RuntimeConfig, Source, SpeculativeConfig
from trtssd.models.catalog import NAMED_ENGINES
from trtssd.runtime import protocol as P
from trtssd.runtime.launch import start_draft, start_target
from trtssd.backends.tensor_parallel import TensorParallelExecutor
from trtssd.sampling import SamplingParams
from trtssd.trtllm.availability import TensorRTLLMMissing, import_tensorrt_llm, tensorrt_llm_available
from trtssd.trtllm.build_commands import (
    EngineLimits, Heads, allowed_tp_sizes, build_command, build_trtllm, check_tp_size, convert_command, plan_for,
    render_script, write_script,
)
from trtssd.trtllm import drafter as drafter_module
from trtssd.trtllm.drafter import SSDDraftSource, first_outcome, make_drafter, open_draft_source, outcome_since, Drafted
from trtssd.trtllm.executor_target import (
    LOG_ZERO, CommunicationMode, EngineParallelism, MpiWorld, TrtllmTargetExecutor, build_verify_request,
    check_runnable, choose_parallel_plan, derive_outcome, draft_logits, engine_parallelism, plan_for_engine,
    read_engine_parallelism, sampling_config_fields,
)
from trtssd.trtllm.executor_target import main as executor_target_main
from trtssd.trtllm.verifier import TrtllmVerifier, trtllm_verifier

ENGINES = Path(__file__).resolve().parent.parent / "engines"
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=32)
V = 16

needs_no_trtllm = pytest.mark.skipif(tensorrt_llm_available(), reason="tensorrt_llm is installed here")


def _q_rows(k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(k, V, generator=g)
    q[:, 3] = 0.0  # tokens the draft could never sample
    return q / q.sum(dim=-1, keepdim=True)


# -- request construction ------------------------------------------------------------------------


def test_greedy_request_carries_tokens_without_logits():
    req = build_verify_request([1, 2, 9], [4, 5, 6], None, False, GREEDY, remaining=10, vocab_size=V, end_id=2)
    assert req.input_token_ids == (1, 2, 9)  # the whole sequence, ending with the pending bonus
    assert req.draft_tokens == (4, 5, 6)
    assert req.max_tokens == 4  # drafts + the target's own next token
    assert req.draft_logits is None
    assert req.end_id == 2


def test_drafts_are_cut_to_what_may_still_be_emitted():
    req = build_verify_request([1], [4, 5, 6], _q_rows(3), False, SAMPLED, remaining=2, vocab_size=V)
    assert (req.draft_tokens, req.max_tokens, tuple(req.draft_logits.shape)) == ((4,), 2, (1, V))
    last = build_verify_request([1], [4, 5, 6], _q_rows(3), False, SAMPLED, remaining=1, vocab_size=V)
    assert (last.draft_tokens, last.max_tokens, last.draft_logits) == ((), 1, None)
    with pytest.raises(ValueError, match="remaining"):
        build_verify_request([1], [4], None, False, GREEDY, remaining=0, vocab_size=V)
    with pytest.raises(ValueError, match=r"draft token ids must be in \[0, 16\)"):
        build_verify_request([1], [4, 99], None, False, GREEDY, remaining=5, vocab_size=V)


def test_sampled_request_logits_softmax_back_to_the_q_rows():
    """TensorRT-LLM softmaxes the draft logits (no temperature) to get q: it must be our q'."""
    q = _q_rows(3)
    req = build_verify_request([1, 2], [4, 5, 6], q, False, SAMPLED, remaining=10, vocab_size=V)
    assert req.draft_logits.dtype == torch.float32 and tuple(req.draft_logits.shape) == (3, V)
    back = torch.softmax(req.draft_logits, dim=-1)
    torch.testing.assert_close(back, q, atol=1e-6, rtol=1e-5)
    assert bool((back[:, 3] == 0).all())  # impossible tokens stay impossible, exactly


def test_point_mass_rows_become_one_hot_logits_that_give_the_point_mass_rule():
    logits = draft_logits([4, 5], None, True, V)
    q = torch.softmax(logits, dim=-1)
    assert q[0, 4] == 1.0 and q[1, 5] == 1.0 and float(q.sum()) == 2.0
    assert float(logits.min()) == LOG_ZERO
    # TensorRT-LLM's kernel: accept with min(1, p(s)/q(s)) = p(s); residual max(p - q, 0) renormalised,
    # which for q = delta_s is p with s removed (docs/algorithm.md section 5, point-mass rule).
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(1)), dim=-1)
    residual = torch.clamp(p - q[0], min=0.0)
    expected = p.clone()
    expected[4] = 0.0
    torch.testing.assert_close(residual / residual.sum(), expected / expected.sum())


def test_a_draft_outside_its_q_row_is_refused():
    q = _q_rows(2)
    with pytest.raises(ValueError, match="probability 0"):
        draft_logits([4, 3], q, False, V)  # token 3 has q = 0


def test_sampling_config_fields_and_min_p_rejection():
    assert sampling_config_fields(GREEDY) == {"beam_width": 1, "top_k": 1}
    assert sampling_config_fields(SAMPLED) == {"beam_width": 1, "temperature": 0.8, "top_k": 20, "top_p": 0.9,
                                               "seed": 7}
    plain = sampling_config_fields(SamplingParams(temperature=1.0))
    assert plain == {"beam_width": 1, "temperature": 1.0}  # top-k/top-p off: not sent at all
    with pytest.raises(ValueError, match="min_p"):
        build_verify_request([1], [4], _q_rows(1), False, SamplingParams(min_p=0.1), remaining=5, vocab_size=V)


# -- outcome derivation --------------------------------------------------------------------------


def test_outcome_all_some_none_accepted():
    drafts = [4, 5, 6]
    every = derive_outcome(drafts, [4, 5, 6, 9], "length", end_id=2)
    assert (every.num_accepted, every.bonus, every.emitted, every.stopped) == (3, 9, (4, 5, 6, 9), False)
    some = derive_outcome(drafts, [4, 5, 8], "length", end_id=2)
    assert (some.num_accepted, some.bonus, some.emitted) == (2, 8, (4, 5, 8))
    none = derive_outcome(drafts, [7], "length", end_id=2)
    assert (none.num_accepted, none.bonus, none.emitted) == (0, 7, (7,))
    assert some.to_protocol(11) == P.Outcome(11, 2, 8)
    plain = derive_outcome([], [7], "length", end_id=2)  # no drafts: a plain decode step
    assert (plain.num_accepted, plain.bonus) == (0, 7)


def test_outcome_stop_inside_the_accepted_run():
    # The end id (2) was the second draft and was accepted; TensorRT-LLM leaves it out of the output.
    left_out = derive_outcome([4, 2, 6], [4], "end_id", end_id=2)
    assert (left_out.num_accepted, left_out.bonus, left_out.emitted, left_out.stopped) == (2, None, (4, 2), True)
    # The same when the output keeps it.
    kept = derive_outcome([4, 2, 6], [4, 2], "end_id", end_id=2)
    assert (kept.num_accepted, kept.bonus, kept.emitted, kept.stopped) == (2, None, (4, 2), True)
    with pytest.raises(ValueError, match="no next round"):
        kept.to_protocol(3)


def test_outcome_end_id_as_the_bonus():
    out = derive_outcome([4, 5], [4], "end_id", end_id=2)  # draft 5 rejected, the target sampled the end id
    assert (out.num_accepted, out.bonus, out.emitted, out.stopped) == (1, 2, (4, 2), True)
    full = derive_outcome([4, 5], [4, 5], "end_id", end_id=2)  # all accepted, then the end id
    assert (full.num_accepted, full.bonus, full.emitted) == (2, 2, (4, 5, 2))


def test_outcome_rejects_impossible_responses():
    with pytest.raises(ValueError, match="more than one token after"):
        derive_outcome([4, 5, 6], [4, 8, 9], "length", end_id=2)
    with pytest.raises(ValueError, match="without a stop"):
        derive_outcome([4, 5, 6], [4, 5], "length", end_id=2)


# -- build command lines -------------------------------------------------------------------------


def _words(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_default_engine_commands_from_the_catalog(tmp_path):
    """A clean checkout: no engine built, no weights; the catalog says llama and int4 self-draft."""
    plan = plan_for("smollm2-135m", tmp_path, k=5)
    assert plan.root == (tmp_path / "smollm2-135m.trtllm").resolve()
    target = build_command(plan.target, plan.limits, plan.k)
    assert _words(target, "--speculative_decoding_mode") == "draft_tokens_external"
    assert _words(target, "--max_draft_len") == "5"
    assert _words(target, "--use_paged_context_fmha") == "enable"
    assert _words(target, "--kv_cache_type") == "paged"
    assert _words(target, "--checkpoint_dir") == str(plan.root / "checkpoint" / "target")
    assert _words(target, "--max_input_len") == "2047" and _words(target, "--max_seq_len") == "2048"
    draft = build_command(plan.draft, plan.limits, plan.k)
    assert "--speculative_decoding_mode" not in draft and "--max_draft_len" not in draft
    assert _words(draft, "--use_paged_context_fmha") == "enable"
    convert = convert_command(plan.draft, plan.limits)
    assert convert[1].endswith("models/core/llama/convert_checkpoint.py")
    assert _words(convert, "--model_dir") == str(plan.root / "hf" / "target")  # the target's own weights
    assert _words(convert, "--weight_only_precision") == "int4" and "--use_weight_only" in convert
    assert "--use_weight_only" not in convert_command(plan.target, plan.limits)


def test_qwen_pair_commands_from_the_catalog(tmp_path):
    plan = plan_for("qwen2.5-coder-1.5b", tmp_path, k=4, limits=EngineLimits(max_batch_size=4, max_seq_len=1024))
    for side in (plan.target, plan.draft):
        convert = convert_command(side, plan.limits)
        assert convert[1] == "$TRTLLM_EXAMPLES/models/core/qwen/convert_checkpoint.py"
        assert "--use_weight_only" not in convert
    assert _words(convert_command(plan.draft, plan.limits), "--model_dir") == str(plan.root / "hf" / "draft")
    assert plan.draft.source_dir == (tmp_path / "qwen2.5-coder-1.5b" / "draft").resolve()
    target = build_command(plan.target, plan.limits, plan.k)
    assert (_words(target, "--max_draft_len"), _words(target, "--max_batch_size"), _words(target, "--max_seq_len")) == (
        "4", "4", "1024")


@pytest.mark.parametrize("name,family,converter", [("smollm2-135m", "llama", "llama"),
                                                    ("qwen2.5-coder-1.5b", "qwen2", "qwen")])
def test_commands_from_a_built_engines_manifest(tmp_path, name, family, converter):
    """A built engine is read from its manifest (the real one when this checkout has it)."""
    real = ENGINES / name / "manifest.json"
    if real.is_file():
        manifest = json.loads(real.read_text())
    else:
        backend = "torch-int4" if name == "smollm2-135m" else "torch"
        manifest = {"architecture": {"arch": family}, "target": {"format": "gguf"}, "draft": {"backend": backend}}
    (tmp_path / name).mkdir()
    (tmp_path / name / "manifest.json").write_text(json.dumps(manifest))
    plan = plan_for(name, tmp_path)
    assert plan.k == NAMED_ENGINES[name].speculation["torch"]["k"]  # the pair's tuned lookahead
    assert plan.target.family == family
    assert f"models/core/{converter}/convert_checkpoint.py" in render_script(plan)
    assert plan.draft.int4_weight_only == (name == "smollm2-135m")


def test_a_manifest_architecture_without_converter_is_refused(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(
        {"architecture": {"arch": "gemma"}, "target": {"format": "gguf"}, "draft": {"backend": "torch"}}))
    with pytest.raises(ValueError, match="'gemma' has no TensorRT-LLM converter"):
        plan_for("x", tmp_path)
    with pytest.raises(ValueError, match="neither built"):
        plan_for("not-an-engine", tmp_path)
    with pytest.raises(ValueError, match="max_draft_len"):
        plan_for("smollm2-135m", tmp_path, k=0)


def test_script_is_valid_bash_with_every_step(tmp_path):
    plan = plan_for("qwen2.5-coder-1.5b", tmp_path)
    script = tmp_path / "build.sh"
    script.write_text(render_script(plan))
    subprocess.run(["bash", "-n", str(script)], check=True)  # syntax only; nothing is run
    text = script.read_text()
    assert text.count("trtllm-build ") == 2 and text.count("/convert_checkpoint.py\" --model_dir") == 2
    assert text.count("gguf_file=gguf") == 2  # both GGUFs are exported (the Qwen draft is its own model)
    assert 'TRTLLM_EXAMPLES="${TRTLLM_EXAMPLES:-' in text and "unverified: never run" in text


# -- without tensorrt_llm ------------------------------------------------------------------------


@needs_no_trtllm
def test_missing_tensorrt_llm_is_reported_clearly(tmp_path):
    with pytest.raises(TensorRTLLMMissing, match=r"`tensorrt_llm` \(TensorRT-LLM 1\.2\.x\)"):
        import_tensorrt_llm(needed_for="a test")
    with pytest.raises(TensorRTLLMMissing, match="The TensorRT-LLM target executor"):
        TrtllmTargetExecutor(tmp_path)
    with pytest.raises(TensorRTLLMMissing, match="The SSD drafter"):
        make_drafter(object(), 4)
    result = build_trtllm("smollm2-135m", tmp_path)
    assert not result.ran and result.script.is_file()
    assert "--max_draft_len 7" in result.script.read_text()  # the default engine's tuned lookahead
    assert "tensorrt_llm" in result.message and str(result.script) in result.message
    assert not (tmp_path / "smollm2-135m").exists()  # nothing fetched or built


@needs_no_trtllm
def test_cli_build_backend_trtllm(tmp_path, capsys, caplog):
    assert main(["build", "qwen2.5-coder-1.5b", "--backend", "trtllm", "--k", "3", "--out", str(tmp_path)]) == 0
    script = Path(capsys.readouterr().out.strip())
    assert script == (tmp_path / "qwen2.5-coder-1.5b.trtllm" / "build.sh").resolve()
    assert "--max_draft_len 3" in script.read_text()
    assert "not importable" in caplog.text and str(script) in caplog.text
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--backend", "trtllm", "--target", str(tmp_path / "m.gguf"), "--out", str(tmp_path)])
    assert exit_info.value.code == 2


# -- the drafter's bookkeeping -------------------------------------------------------------------


def test_outcomes_from_request_tokens():
    prefill, first = first_outcome(5, [10, 11, 12, 40], prompt_len=3)
    assert prefill.prompt == (10, 11, 12) and first == P.Outcome(5, 0, 40)
    drafted = Drafted(num_tokens=4, drafts=(41, 42, 43))
    assert outcome_since(5, [10, 11, 12, 40, 41, 42, 99], drafted) == P.Outcome(5, 2, 99)
    assert outcome_since(5, [10, 11, 12, 40, 41, 42, 43, 44], drafted) == P.Outcome(5, 3, 44)
    assert outcome_since(5, [10, 11, 12, 40, 77], drafted) == P.Outcome(5, 0, 77)
    # A step decoded without drafts after the verification: its tokens are plain ones.
    assert outcome_since(5, [10, 11, 12, 40, 41, 99, 7], drafted) == P.Outcome(5, 1, 99, (7,))
    assert outcome_since(5, [10, 11, 12, 40], drafted) is None


class FakeDraftClient:
    """Answers every row with the chain [base + 1, ..., base + k] where base = the row's bonus."""

    def __init__(self, k: int):
        self.k, self.alive, self.pid, self.step_s = k, True, None, None
        self.sent: list = []
        self.requests: list[P.SpeculateRequest] = []

    def send(self, msg):
        self.sent.append(msg)
        return True

    def speculate(self, req):
        self.requests.append(req)
        rows = [[o.bonus + i for i in range(1, self.k + 1)] for o in req.outcomes]
        n = len(req.outcomes)
        reply = P.SpeculateReply(req.round_id, req.buffer, (Source.HIT,) * n, (False,) * n, False, 0.0, 0.0)
        return reply, torch.tensor(rows), None

    def mark_dead(self, reason):
        self.alive = False


class FakeRequest:
    """The fields of TensorRT-LLM's LlmRequest that the drafter reads and writes."""

    def __init__(self, request_id: int, tokens: list[int], prompt_len: int = 3, max_new: int = 20):
        self.request_id, self.tokens = request_id, list(tokens)
        self.py_orig_prompt_len, self.py_max_new_tokens = prompt_len, max_new
        self.py_draft_tokens = None

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


def _request(request_id, tokens, prompt_len=3, max_new=20):
    return FakeRequest(request_id, tokens, prompt_len, max_new)


def _scheduled(*requests):
    return SimpleNamespace(generation_requests=list(requests))


def test_drafter_asks_the_draft_rank_for_each_outcome():
    client = FakeDraftClient(k=3)
    source = SSDDraftSource(client, max_draft_len=3)
    a = _request(1, [10, 11, 12, 40])
    source.prepare_draft_tokens(_scheduled(a))
    assert client.sent == [P.Prefill(1, (10, 11, 12), source.params)]
    assert client.requests[-1].outcomes == (P.Outcome(1, 0, 40),)
    assert a.py_draft_tokens == [41, 42, 43]
    a.tokens += [41, 42, 50]  # TensorRT-LLM accepted two drafts, then its own token 50
    b = _request(2, [20, 21, 60], prompt_len=2)
    source.prepare_draft_tokens(_scheduled(a, b))
    assert client.requests[-1].outcomes == (P.Outcome(1, 2, 50), P.Outcome(2, 0, 60))
    assert (a.py_draft_tokens, b.py_draft_tokens) == ([51, 52, 53], [61, 62, 63])
    assert [r.buffer for r in client.requests] == [0, 1]  # the two shared buffers alternate
    b.tokens += [61, 62, 63, 64]
    source.prepare_draft_tokens(_scheduled(b))  # request 1 has finished
    assert client.requests[-1].released == (1,)
    assert client.requests[-1].outcomes == (P.Outcome(2, 3, 64),)


def test_drafter_never_drafts_past_the_last_token():
    client = FakeDraftClient(k=3)
    source = SSDDraftSource(client, max_draft_len=3)
    a = _request(1, [10, 11, 12, 40], max_new=3)  # 1 of 3 new tokens generated: room for 1 draft + bonus
    source.prepare_draft_tokens(_scheduled(a))
    assert a.py_draft_tokens == [41]


def test_drafter_without_a_draft_rank_proposes_nothing():
    client = FakeDraftClient(k=3)
    client.alive = False
    source = SSDDraftSource(client, max_draft_len=3)
    a = _request(1, [10, 11, 12, 40])
    source.prepare_draft_tokens(_scheduled(a))
    assert a.py_draft_tokens == [] and client.requests == []


# -- the TensorRT-LLM verifier through the target loop's seam ------------------------------------

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12, [42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("trtllm"))


class FakeTrtllmExecutor:
    """Stands in for TensorRT-LLM's Executor responses (greedy only): each request is scored from
    scratch by the tiny target, its output is what the engine returns (the drafts the target's
    argmax agrees with, then the target's own token), and the outcome comes from the same
    ``derive_outcome`` the real executor uses. Tests our seam and outcome logic, not TensorRT-LLM."""

    def __init__(self, target_path: Path):
        self.model = TorchExecutor.from_pretrained(target_path, max_seqs=1, max_seq_len=512)
        self.requests: list = []

    def verify(self, requests, params):
        assert all(p.is_greedy for p in params), "the stand-in scores greedy requests only"
        self.requests += requests
        return [derive_outcome(r.draft_tokens, self._output(r), "length", r.end_id) for r in requests]

    def _output(self, request) -> list[int]:
        assert request.draft_logits is None and request.max_tokens == len(request.draft_tokens) + 1
        tokens = list(request.input_token_ids) + list(request.draft_tokens)
        self.model.add_sequence(0)
        try:
            logits = self.model.forward([chain_chunk(0, tokens, 0)])[0]
        finally:
            self.model.release(0)
        target = logits[len(request.input_token_ids) - 1:].argmax(-1).tolist()  # after the bonus, each draft
        out = []
        for draft, wanted in zip(request.draft_tokens, target):
            out.append(wanted)
            if draft != wanted:
                return out
        return out + [target[len(request.draft_tokens)]]


def _tiny_llm(tiny, mode: str, **kw) -> LLM:
    return LLM(target=ModelRef(str(tiny[0])), draft=ModelRef(str(tiny[1])), mode=mode, launch="local",
               max_model_len=256, plain_under_load=False, **kw)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_trtllm_verifier_gives_the_greedy_tokens_of_ar(tiny, mode):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (9, 23, 14, 5)]
    with _tiny_llm(tiny, "ar") as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, params)]
    fake = FakeTrtllmExecutor(tiny[0])
    with _tiny_llm(tiny, mode, max_batch=2) as llm:
        llm.loop.verifier = TrtllmVerifier(fake, llm.loop.target.vocab_size)
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        summary = llm.metrics.summary()
    assert got == ref
    assert summary["degraded_rounds"] == 0
    drafted = [r for r in fake.requests if r.draft_tokens]
    assert bool(drafted) == (mode != "ar")  # ar: plain rounds only, each a request without drafts
    for r in fake.requests:  # never more than the request may still emit
        assert r.max_tokens == len(r.draft_tokens) + 1 and r.end_id is None


def test_trtllm_verifier_refuses_what_tensorrt_llm_cannot_honour(tiny):
    with _tiny_llm(tiny, "ar") as llm:
        llm.loop.verifier = TrtllmVerifier(FakeTrtllmExecutor(tiny[0]), llm.loop.target.vocab_size)
        with pytest.raises(ValueError, match="min_p"):
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0.8, min_p=0.1, max_tokens=4))
        assert not llm.loop.has_unfinished()


@pytest.mark.parametrize("kwargs, match", [
    (dict(verifier="tensorrt"), "verifier must be one of 'executor', 'trtllm'"),
    (dict(verifier="trtllm"), "trtllm_engine_dir is required with verifier 'trtllm'"),
    (dict(trtllm_engine_dir="/x"), "allowed only with it"),
])
def test_verifier_options_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RuntimeConfig(**kwargs)


@needs_no_trtllm
def test_llm_with_the_trtllm_backend_says_what_is_missing(tiny, tmp_path):
    with pytest.raises(TensorRTLLMMissing, match="needs the Python package `tensorrt_llm`"):
        _tiny_llm(tiny, "ar", verifier="trtllm", trtllm_engine_dir=str(tmp_path))


# -- the drafter on a draft rank of its own --------------------------------------------------------


def _draft_greedy(draft_path: Path, tokens: list[int], n: int) -> list[int]:
    """The draft model's own greedy continuation (what an sd draft rank proposes)."""
    model = TorchExecutor.from_pretrained(draft_path, max_seqs=1, max_seq_len=256)
    model.add_sequence(0)
    out, seq = [], list(tokens)
    for _ in range(n):
        logits = model.forward([chain_chunk(0, seq, 0)])[0]
        seq.append(int(logits[-1].argmax()))
        out.append(seq[-1])
    return out


@pytest.mark.mpi
def test_drafter_on_its_own_spawned_draft_rank(tiny):
    """Prefill, two greedy speculations and a release against a real draft rank the drafter
    started (its own MPI job); close() ends the job and frees its buffers."""
    with open_draft_source(draft=ModelRef(str(tiny[1])), vocab_size=64, mode="sd", k=3, max_batch=2,
                           max_model_len=128) as source:
        link = source.client
        a = _request(1, [1, 2, 3, 4, 5, 9], prompt_len=5)
        source.prepare_draft_tokens(_scheduled(a))
        assert a.py_draft_tokens == _draft_greedy(tiny[1], a.tokens, 3)
        first = a.py_draft_tokens
        a.tokens += [first[0], (first[1] + 1) % 64]  # one draft accepted, then another token
        source.prepare_draft_tokens(_scheduled(a))
        assert a.py_draft_tokens == _draft_greedy(tiny[1], a.tokens, 3)
        source.prepare_draft_tokens(_scheduled())  # request 1 finished: released on the draft rank
        assert link.alive and source._drafted == {}
    assert not link.alive and not link.job.running() and link.buffers is None
    assert link.job._live_processes() == []


def test_drafter_options_are_checked_and_a_refused_drafter_leaves_no_draft(tiny, monkeypatch):
    with pytest.raises(ValueError, match="mode must be 'sd' or 'ssd' for a drafter"):
        open_draft_source(draft=ModelRef(str(tiny[1])), vocab_size=64, mode="ar")
    with pytest.raises(TypeError, match="unknown drafter option"):
        open_draft_source(draft=ModelRef(str(tiny[1])), vocab_size=64, colour="red")
    closed = []

    def start(*args):
        client = start_draft(*args)
        client.close = lambda: closed.append(True)
        return client

    monkeypatch.setattr(drafter_module, "start_draft", start)
    with pytest.raises(ValueError, match=r"max_draft_len must be an int in \[1, k=3\]"):
        open_draft_source(draft=ModelRef(str(tiny[1])), vocab_size=64, mode="sd", k=3, max_draft_len=4,
                          launch="local", max_model_len=128)
    assert closed == [True]  # the draft it had started was ended


@needs_no_trtllm
def test_make_drafter_without_tensorrt_llm_starts_nothing(tiny, monkeypatch):
    monkeypatch.setattr(drafter_module, "start_draft", lambda *a: pytest.fail("a draft rank was started"))
    with pytest.raises(TensorRTLLMMissing, match="The SSD drafter needs"):
        make_drafter(draft=ModelRef(str(tiny[1])), vocab_size=64, mode="sd")


# -- tensor parallelism: the T-way target engine and the executor's parallel mode ------------------


def _built_manifest(tmp_path: Path, name: str, heads: int, kv_heads: int) -> None:
    """A built engine's manifest with the target's heads (what `trtssd build` records)."""
    (tmp_path / name).mkdir()
    manifest = {"architecture": {"arch": "llama", "num_heads": heads, "num_kv_heads": kv_heads},
                "target": {"format": "gguf"}, "draft": {"backend": "torch-int4"}}
    (tmp_path / name / "manifest.json").write_text(json.dumps(manifest))


def test_build_script_for_tp_size_2_splits_the_target_only(tmp_path):
    plan = plan_for("qwen2.5-coder-1.5b", tmp_path, tp_size=2)
    convert = convert_command(plan.target, plan.limits)
    build = build_command(plan.target, plan.limits, plan.k)
    assert convert[convert.index("--tp_size") + 1] == "2"
    assert build[build.index("--workers") + 1] == "2"  # the two ranks built at once, one GPU each
    assert "--tp_size" not in convert_command(plan.draft, plan.limits)  # the draft stays one rank
    assert "--workers" not in build_command(plan.draft, plan.limits, plan.k)
    text = render_script(plan)
    assert text.count("--tp_size 2") == 1 and text.count("--workers 2") == 1
    assert "rank0.engine..rank1.engine" in text
    script = write_script(plan)
    subprocess.run(["bash", "-n", str(script)], check=True)
    manifest = json.loads(plan.manifest.read_text())
    assert manifest["target"] == {"engine_dir": str(plan.target.engine_dir), "tp_size": 2}
    assert manifest["draft"]["tp_size"] == 1 and manifest["max_draft_len"] == plan.k
    # tp_size 1 leaves the commands as they always were.
    single = plan_for("qwen2.5-coder-1.5b", tmp_path)
    assert "--tp_size" not in render_script(single) and "--workers" not in render_script(single)


def test_tp_size_must_divide_the_heads_and_names_the_allowed_values(tmp_path):
    _built_manifest(tmp_path, "smol", heads=9, kv_heads=3)
    assert plan_for("smol", tmp_path, tp_size=3).tp_size == 3
    with pytest.raises(ValueError, match=r"tp_size=2 does not divide .*num_attention_heads=9, "
                                         r"num_key_value_heads=3\); allowed values: 1, 3$"):
        plan_for("smol", tmp_path, tp_size=2)
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(ValueError, match=r"tp_size .* must be an int >= 1; got"):
            plan_for("smol", tmp_path, tp_size=bad)
    assert allowed_tp_sizes(Heads(12, 2)) == [1, 2]  # Qwen2.5-1.5B
    assert allowed_tp_sizes(Heads(32, 8)) == [1, 2, 4, 8]
    assert check_tp_size(4, None) == 4  # heads unknown (a named engine not built yet): positive is enough


@needs_no_trtllm
def test_cli_build_tp_size(tmp_path, capsys):
    assert main(["build", "qwen2.5-coder-1.5b", "--backend", "trtllm", "--tp-size", "2", "--out", str(tmp_path)]) == 0
    script = Path(capsys.readouterr().out.strip())
    assert "--tp_size 2" in script.read_text()
    assert json.loads((script.parent / "trtllm.json").read_text())["target"]["tp_size"] == 2
    with pytest.raises(SystemExit) as exit_info:  # the torch target is split at run time, not here
        main(["build", "--tp-size", "2", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--tp-size is for --backend trtllm" in capsys.readouterr().err


def _engine_config(tmp_path: Path, tp: int, pp: int = 1) -> Path:
    """An engine directory as trtllm-build leaves it, as far as parallelism goes."""
    engine = tmp_path / f"engine-tp{tp}-pp{pp}"
    engine.mkdir()
    mapping = {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    (engine / "config.json").write_text(json.dumps({"version": "1.2.1", "pretrained_config": {"mapping": mapping},
                                                    "build_config": {}}))
    return engine


def test_engine_parallelism_from_its_config(tmp_path):
    assert read_engine_parallelism(_engine_config(tmp_path, 2)) == EngineParallelism(2, 1, 1)
    assert read_engine_parallelism(_engine_config(tmp_path, 2, pp=2)).world_size == 4
    assert engine_parallelism({"pretrained_config": {"mapping": {"tp_size": 4}}}) == EngineParallelism(4)
    with pytest.raises(ValueError, match="pretrained_config.mapping.tp_size"):
        engine_parallelism({"pretrained_config": {"mapping": {"world_size": 2}}})
    with pytest.raises(ValueError, match=r"ints >= 1; got \{'tp_size': 0\}"):
        engine_parallelism({"pretrained_config": {"mapping": {"tp_size": 0}}})
    with pytest.raises(ValueError, match="has no config.json: it is not a trtllm-build output"):
        read_engine_parallelism(tmp_path)


def test_one_process_runs_a_multi_rank_engine_as_orchestrator():
    single = choose_parallel_plan(EngineParallelism(1), MpiWorld(1, 0))
    assert (single.mode, single.device_ids, single.participant_ids, single.enqueues) == (
        CommunicationMode.LEADER, None, None, True)  # as a one-GPU engine always ran
    plan = choose_parallel_plan(EngineParallelism(4), MpiWorld(1, 0))
    assert (plan.mode, plan.world_size, plan.device_ids, plan.participant_ids) == (
        CommunicationMode.ORCHESTRATOR, 4, (0, 1, 2, 3), None)
    assert plan.enqueues and not plan.is_follower and plan.draft_rank is None
    given = choose_parallel_plan(EngineParallelism(2), MpiWorld(1, 0), device_ids=[6, 7])
    assert given.device_ids == (6, 7)
    assert choose_parallel_plan(EngineParallelism(2, pp_size=2), MpiWorld()).device_ids == (0, 1, 2, 3)
    for bad in ([0], [1, 1], [0, -1]):
        with pytest.raises(ValueError, match=r"device_ids must be 2 distinct CUDA device indices"):
            choose_parallel_plan(EngineParallelism(2), MpiWorld(), device_ids=bad)


def test_an_mpi_world_of_the_engines_size_runs_it_in_leader_mode():
    leader = choose_parallel_plan(EngineParallelism(2), MpiWorld(2, 0))
    assert (leader.mode, leader.participant_ids, leader.device_ids, leader.draft_rank) == (
        CommunicationMode.LEADER, (0, 1), (0, 1), None)
    assert leader.enqueues and not leader.is_follower
    follower = choose_parallel_plan(EngineParallelism(2), MpiWorld(2, 1), device_ids=(2, 3))
    assert not follower.enqueues and follower.is_follower and follower.device_ids == (2, 3)
    with pytest.raises(ValueError, match=r"engine of 2 rank\(s\) cannot run in an MPI world of 5"):
        choose_parallel_plan(EngineParallelism(2), MpiWorld(5, 0))


def test_leader_mode_with_the_draft_as_last_rank_is_refused_with_the_reason():
    plan = choose_parallel_plan(EngineParallelism(2), MpiWorld(3, 0))
    assert (plan.participant_ids, plan.draft_rank, plan.enqueues) == ((0, 1), 2, True)
    with pytest.raises(ValueError, match=r"draft as MPI rank 2 .* importing tensorrt_llm splits MPI_COMM_WORLD"):
        check_runnable(plan)
    with pytest.raises(ValueError, match="MPI rank 2 is outside the engine's ranks 0..1"):
        choose_parallel_plan(EngineParallelism(2), MpiWorld(3, 2))
    # trtssd's launch "world" at T = 1 (mpiexec -n 2): the same refusal, before tensorrt_llm is imported.
    with pytest.raises(ValueError, match="draft as MPI rank 1"):
        check_runnable(choose_parallel_plan(EngineParallelism(1), MpiWorld(2, 0)))


def test_plan_for_engine_checks_the_tensor_parallel_size(tmp_path):
    engine = _engine_config(tmp_path, 2)
    plan = plan_for_engine(engine, tensor_parallel_size=2, world=MpiWorld(1, 0))
    assert plan.mode is CommunicationMode.ORCHESTRATOR and plan.device_ids == (0, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 but the TensorRT-LLM engine in .* has "
                                         r"tp_size=2 .*--tp-size 4"):
        plan_for_engine(engine, tensor_parallel_size=4, world=MpiWorld(1, 0))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=1 but the TensorRT-LLM engine in .* has tp_size=2"):
        plan_for_engine(engine, tensor_parallel_size=1, world=MpiWorld(1, 0))


def test_the_verifier_refuses_an_engine_of_two_ranks_at_tensor_parallel_size_1(tmp_path, monkeypatch):
    # As if tensorrt_llm were installed: the engine's size is checked before anything of it is imported.
    monkeypatch.setattr("trtssd.trtllm.executor_target.tensorrt_llm_available", lambda: True)
    engine = _engine_config(tmp_path, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=1 but the TensorRT-LLM engine in .* has tp_size=2"):
        trtllm_verifier(engine, vocab_size=32)


def _trtllm_runtime(engine: Path, size: int) -> RuntimeConfig:
    return RuntimeConfig(verifier="trtllm", trtllm_engine_dir=str(engine), tensor_parallel_size=size,
                         max_model_len=64, max_batch=2)


def test_start_target_routes_a_trtllm_target_of_tensor_parallel_size_2(tiny, tmp_path):
    engine = _engine_config(tmp_path, 2)
    executor = start_target(ModelRef(str(tiny[0])), SpeculativeConfig(), _trtllm_runtime(engine, 2), "local")
    # Prefill's torch target loads whole here; TensorRT-LLM runs the engine's two ranks itself.
    assert isinstance(executor, TorchExecutor) and not isinstance(executor, TensorParallelExecutor)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 but the TensorRT-LLM engine in .* has tp_size=2"):
        start_target(ModelRef(str(tiny[0])), SpeculativeConfig(), _trtllm_runtime(engine, 4), "local")
    with pytest.raises(ValueError, match="launch 'world' cannot run a TensorRT-LLM engine"):
        start_target(ModelRef(str(tiny[0])), SpeculativeConfig(), _trtllm_runtime(engine, 2), "world")
    with pytest.raises(ValueError, match="trtllm_engine_dir: no tp_size readable from"):
        start_target(ModelRef(str(tiny[0])), SpeculativeConfig(), _trtllm_runtime(tmp_path, 2), "local")


@needs_no_trtllm
def test_follower_entry_point_says_what_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        executor_target_main([str(_engine_config(tmp_path, 2))])
    assert exit_info.value.code == 2
    assert "A TensorRT-LLM engine rank needs the Python package `tensorrt_llm`" in capsys.readouterr().err
