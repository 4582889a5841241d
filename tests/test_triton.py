"""The Triton model repository on a real tritonserver (the nvidia-pytriton wheel's, on 127.0.0.1
and free ports), started by `trtssd triton-serve` on a repository written by `trtssd triton-repo`
for the real default engine in ssd mode, its draft rank a separate MPI process. Talked to with
tritonclient (gRPC streaming, HTTP) and through the HTTP generate / generate_stream endpoints.
First the parts that need no server (request parsing, config, metric names).

The server tests share one server and run in file order; the last one stops it (SIGINT to
`trtssd triton-serve`) and checks that nothing it started is left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from request_records import finished
from sse_client import scrape
from trtssd import LLM, SamplingParams
from trtssd.cli import main as cli_main
from trtssd.runtime.metrics import SpeculationMetrics
from trtssd.serving.prometheus_metrics import ServerMetrics
from trtssd.triton import metrics as triton_metrics
from trtssd.triton.repository import config_pbtxt, write_repository
from trtssd.processes import descendants, mapped_segments, start_time
from trtssd.triton.server import SHM_PREFIXES, free_port
from trtssd.triton.tensors import INPUTS, LOG_PROB_OUTPUTS, OUTPUTS
from trtssd.triton.triton_requests import DEFAULT_MAX_TOKENS, parse_request
from trtssd.triton.triton_responses import output_arrays

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea."]
GREEDY_TOKENS = 20
MAX_SEQ_LEN = 256
SERVER_FANOUT = (2, 1, 1, 1, 1, 1)  # fixed: skips the draft's start-up calibration that "auto" needs
SEEDED = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)  # a seeded sampled request
# The default engine's fp32 forward gives logprobs that differ by up to 1.7e-5 between batch shapes
# (measured: the same greedy prompts in ar batched and alone, and in sd/ssd, whose verify shapes
# follow cache hits), so values from two runs agree to this, not to 1e-5.
LOGPROB_TOL = 1e-4
CLIENT_TYPES = {"TYPE_STRING": "BYTES", "TYPE_BOOL": "BOOL", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32",
                "TYPE_UINT64": "UINT64"}
NUMPY_TYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64}


# --- without a server ------------------------------------------------------------------------------

class FakeTokenizer:
    bos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _inputs(**values) -> dict[str, np.ndarray]:
    """Request tensors as Triton hands them to the model."""
    types = {spec.name: NUMPY_TYPES[CLIENT_TYPES[spec.data_type]] for spec in INPUTS}
    out = {}
    for name, value in values.items():
        value = [v.encode() if isinstance(v, str) else v for v in (value if isinstance(value, list) else [value])]
        out[name] = np.array(value, dtype=types[name])
    return out


def test_request_defaults_follow_vllms_backend():
    req = parse_request(_inputs(text_input="hi"), {}, FakeTokenizer())
    assert req.prompt_ids == [ord("h"), ord("i")]
    assert req.params == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)  # no logprobs computed
    assert not req.stream and req.prepend_input  # non-streaming output repeats the prompt unless excluded
    assert not req.return_log_probs
    streamed = parse_request(_inputs(text_input="hi", stream=True), {}, FakeTokenizer())
    assert streamed.stream and not streamed.prepend_input
    excluded = parse_request(_inputs(text_input="hi", exclude_input_in_output=True), {}, FakeTokenizer())
    assert not excluded.prepend_input


def test_sampling_settings_json_then_parameters_then_tensors():
    given = _inputs(text_input="hi", temperature=0.5, stop_words=["x", "yz"],
                    sampling_parameters=json.dumps({"temperature": "0.1", "top_p": "0.95", "max_tokens": "7",
                                                    "top_k": -1, "seed": 3, "stop": "q"}))
    req = parse_request(given, {"top_p": 0.5, "accumulate_tokens": True, "min_p": 0.1}, FakeTokenizer())
    p = req.params
    assert (p.temperature, p.top_p, p.max_tokens, p.top_k, p.seed, p.min_p) == (0.5, 0.5, 7, 0, 3, 0.1)
    assert p.stop == ("x", "yz")
    seeded = parse_request(_inputs(text_input="hi", seed=2**40, max_tokens=5, ignore_eos=True, top_k=4), {},
                           FakeTokenizer())
    assert (seeded.params.seed, seeded.params.max_tokens, seeded.params.ignore_eos, seeded.params.top_k) == \
        (2**40, 5, True, 4)


def test_return_log_probs_asks_the_engine_for_the_chosen_tokens_only():
    asked = parse_request(_inputs(text_input="hi", return_log_probs=True), {}, FakeTokenizer())
    assert asked.return_log_probs and asked.params.logprobs == 0
    # vLLM's key is checked but asks for nothing: no output carries its alternatives.
    vllm_style = _inputs(text_input="hi", sampling_parameters=json.dumps({"logprobs": 5}))
    assert parse_request(vllm_style, {}, FakeTokenizer()).params.logprobs is None
    vllm_style["return_log_probs"] = np.array([True])
    assert parse_request(vllm_style, {}, FakeTokenizer()).params.logprobs == 0
    off = parse_request(_inputs(text_input="hi", return_log_probs=False), {}, FakeTokenizer())
    assert not off.return_log_probs and off.params.logprobs is None


@pytest.mark.parametrize("inputs, message", [
    (dict(), "'text_input' is required"),
    (dict(text_input="hi", sampling_parameters='{"logprobs": 21}'), "SamplingParams.logprobs"),
    (dict(text_input="hi", sampling_parameters='{"logprobs": "many"}'), "'logprobs' in sampling_parameters"),
    (dict(text_input="hi", return_log_probs=[True, False]), "'return_log_probs' must hold one boolean"),
    (dict(text_input=""), "non-empty"),
    (dict(text_input="hi", sampling_parameters="{nope"), "not valid JSON"),
    (dict(text_input="hi", sampling_parameters='{"beam_width": 2}'), "unknown key(s) ['beam_width']"),
    (dict(text_input="hi", sampling_parameters='{"temperature": "hot"}'), "'temperature' in sampling_parameters"),
    (dict(text_input="hi", temperature=-1.0), "SamplingParams.temperature"),
    (dict(text_input="hi", stream=True, exclude_input_in_output=False), "not allowed with 'stream'"),
])
def test_bad_requests_name_the_field(inputs, message):
    with pytest.raises(ValueError) as err:
        parse_request(_inputs(**inputs), {}, FakeTokenizer())
    assert message in str(err.value)


def test_a_non_boolean_flag_is_refused_by_name():
    given = {**_inputs(text_input="hi"), "return_log_probs": np.array([1], dtype=np.int32)}
    with pytest.raises(ValueError, match="'return_log_probs' must be a boolean"):
        parse_request(given, {}, FakeTokenizer())


def test_output_arrays_carry_the_speculation_figures():
    spec = SpeculationMetrics(num_drafts=2, num_draft_tokens=10, num_accepted_tokens=8, cache_hits=1, cache_misses=1)
    arrays = output_arrays("ab", [5, 6], 3, 2, "length", spec)
    assert set(arrays) == {s.name for s in OUTPUTS} - set(LOG_PROB_OUTPUTS)  # not asked for: not sent
    assert arrays["acceptance_rate"][0] == pytest.approx(0.8) and arrays["cache_hit_rate"][0] == pytest.approx(0.5)
    assert arrays["total_draft_tokens"][0] == 10 and arrays["output_ids"].tolist() == [5, 6]
    assert output_arrays("", [], 3, 0)["acceptance_rate"][0] == 0.0  # before the last response


def test_log_prob_outputs_have_tensorrt_llms_shapes_less_the_batch():
    arrays = output_arrays("ab", [5, 6], 3, 4, log_probs=[-0.25, -1.5], cum_log_prob=-2.0)
    assert arrays["output_log_probs"].shape == (1, 2) and arrays["output_log_probs"].dtype == np.float32
    assert arrays["output_log_probs"][0].tolist() == [-0.25, -1.5] and arrays["cum_log_probs"].tolist() == [-2.0]
    assert output_arrays("", (), 3, 4, log_probs=[], cum_log_prob=-2.0)["output_log_probs"].shape == (1, 0)
    with pytest.raises(ValueError, match="1 log-probabilities for 2 tokens"):
        output_arrays("ab", [5, 6], 3, 2, log_probs=[-0.25])


def test_config_is_decoupled_python_with_every_tensor():
    text = config_pbtxt()
    assert 'backend: "python"' in text and "max_batch_size: 0" in text and "decoupled: true" in text
    assert all(f'name: "{s.name}"' in text for s in INPUTS + OUTPUTS)
    assert "kind: KIND_CPU" in text and "TRTSSD_SITE_PACKAGES" in text
    gpu = config_pbtxt("gpu", (0, 1))
    assert gpu.count("kind: KIND_GPU") == 2 and "UNVERIFIED" in gpu


def test_repository_refuses_bad_options(tmp_path):
    with pytest.raises(TypeError, match="unknown LLM option"):
        write_repository(tmp_path, str(tmp_path), {"max_bach": 4})
    with pytest.raises(ValueError, match="k must be"):
        write_repository(tmp_path, str(tmp_path), {"k": 0})
    with pytest.raises(ValueError, match="not an engine directory"):
        write_repository(tmp_path, str(tmp_path), {})


class FakeMetric:
    def __init__(self, family, labels):
        self.family, self.labels, self.value, self.observed = family, labels, 0.0, []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: list = []

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.made.append(self)

    def Metric(self, labels=None, buckets=None):  # noqa: N802 - pb_utils' name
        self.metrics.append(FakeMetric(self, labels))
        return self.metrics[-1]


def test_metrics_are_the_openai_servers_and_count_a_request():
    families = ServerMetrics("m", 3).registry.collect()
    expected = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert triton_metrics.exposed_names() == expected

    FakeFamily.made = []
    m = triton_metrics.TritonMetrics(SimpleNamespace(MetricFamily=FakeFamily), "trtssd", k=3)
    spec = SpeculationMetrics(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=5, cache_hits=2,
                       accepted_per_position=[2, 2, 1], tree_branches=3, round_time_s=1.0, verify_time_s=0.5)
    m.observe(finished("r", 4, (1, 2, 3), "abc", "length", 0.1, 0.5, (0.2, 0.2), spec))
    value = {(f.name, tuple(sorted(x.labels.items()))): x for f in FakeFamily.made for x in f.metrics}
    base = (("engine", "0"), ("model_name", "trtssd"))
    assert value[("vllm:prompt_tokens_total", base)].value == 4
    assert value[("vllm:spec_decode_num_accepted_tokens_total", base)].value == 5
    assert value[("vllm:request_success_total", tuple(sorted(base + (("finished_reason", "length"),))))].value == 1
    assert value[("vllm:inter_token_latency_seconds", base)].observed == [0.2, 0.2]
    assert value[("trtssd:overlap_efficiency", base)].observed == [0.5]


def test_triton_and_the_openai_server_count_the_same():
    """Both apply the catalog's additions: every Triton series ends with the registry's total."""
    FakeFamily.made = []
    triton = triton_metrics.TritonMetrics(SimpleNamespace(MetricFamily=FakeFamily), "m", k=3)
    server = ServerMetrics("m", 3)
    spec = SpeculationMetrics(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4, accepted_per_position=[2, 2, 0],
                       cache_hits=1, cache_misses=1, accepted_on_hit=3, accepted_on_miss=1, fast_backups=1,
                       tree_branches=5, round_time_s=2.0, verify_time_s=1.5)
    for record in (finished("r", 7, (1, 2, 3), "abc", "stop", 0.1, 0.9, (0.2, 0.3), spec),
                   finished("a", 3, (), "", "abort", None, 0.05, (), SpeculationMetrics())):
        triton.observe(record)
        server.observe(record)
    sample = server.registry.get_sample_value
    series = [(f, x) for f in FakeFamily.made for x in f.metrics]
    for family, metric in series:
        if family.kind == FakeFamily.HISTOGRAM:
            assert sample(family.name + "_count", metric.labels) == len(metric.observed), family.name
            assert sample(family.name + "_sum", metric.labels) == sum(metric.observed), family.name
        elif family.kind == FakeFamily.COUNTER:
            assert sample(family.name, metric.labels) == metric.value, (family.name, metric.labels)
    # 22 unlabelled (4 of prefix caching, 2 of spare-row guesses, 4 of structured outputs); 3 positions, 2 backups, 2
    # finish reasons (stop, abort)
    assert sum(family.kind == FakeFamily.COUNTER for family, _ in series) == 22 + 3 + 2 + 2


# --- one real server ------------------------------------------------------------------------------

def server_test(test):
    """A test on the shared server: the real model, real MPI processes, the wheel's tritonserver."""
    needs_triton = pytest.mark.skipif(importlib.util.find_spec("pytriton") is None,
                                      reason="needs the 'triton' extra (nvidia-pytriton)")
    return needs_triton(pytest.mark.slow(pytest.mark.mpi(test)))


def _segments_and_processes(root: int) -> tuple[dict[int, float], set[str]]:
    pids = {pid: start_time(pid) for pid in [root, *descendants(root)]}
    segments = set().union(*(mapped_segments(pid, SHM_PREFIXES) for pid in pids))
    return {p: s for p, s in pids.items() if s is not None}, segments


@pytest.fixture(scope="module")
def engine():
    from trtssd.build import default_engine

    return default_engine()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    """`trtssd triton-serve` on a `trtssd triton-repo` repository; stopped by the last test."""
    repo = tmp_path_factory.mktemp("triton-repo")
    # A fixed fan-out skips the draft's start-up calibration that "auto" needs (seconds on a CPU).
    assert cli_main(["triton-repo", "--out", str(repo), "--engine", str(engine), "--mode", "ssd", "--max-batch", "4",
                     "--max-model-len", str(MAX_SEQ_LEN), "--fanout", ",".join(map(str, SERVER_FANOUT))]) == 0
    ports = SimpleNamespace(http=free_port(), grpc=free_port(), metrics=free_port())
    log_path = repo / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "trtssd.cli", "--log-level", "INFO", "triton-serve", str(repo),
             "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    s = SimpleNamespace(process=process, ports=ports, log=log_path, http=f"http://127.0.0.1:{ports.http}",
                        grpc=f"127.0.0.1:{ports.grpc}", metrics=f"http://127.0.0.1:{ports.metrics}")
    try:
        _wait_ready(s, timeout_s=600)
        yield s
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.wait(120)


def _wait_ready(s, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert s.process.poll() is None, f"triton-serve exited:\n{s.log.read_text()[-4000:]}"
        try:
            if httpx.get(f"{s.http}/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not ready in {timeout_s} s:\n{s.log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy output of LLM.generate in ar mode: what every greedy request must reproduce."""
    with LLM(str(engine), mode="ar", max_batch=4, max_model_len=MAX_SEQ_LEN) as llm:
        outs = {o.prompt: o for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS,
                                                                          logprobs=0))}
        text = outs[PROMPTS[0]].text
        stop = text[len(text) // 2:len(text) // 2 + 3]  # a stop string the greedy output runs into
        stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, stop=(stop,)))[0]
    return SimpleNamespace(outputs=outs, stop=stop, stopped=stopped)


@pytest.fixture(scope="module")
def sampled_reference(engine):
    """The seeded sampled request offline, in the server's mode and K (the draft in-process): a seed
    makes the output a function of prompt, parameters, seed, engine, mode and K only."""
    with LLM(str(engine), mode="ssd", launch="local", fanout=SERVER_FANOUT, max_batch=4,
             max_model_len=MAX_SEQ_LEN) as llm:
        return llm.generate(PROMPTS[1], SamplingParams(**SEEDED, logprobs=0))[0]


def _grpc_inputs(**values):
    import tritonclient.grpc as grpcclient

    from tritonclient.utils import np_to_triton_dtype

    types = {spec.name: CLIENT_TYPES[spec.data_type] for spec in INPUTS}
    inputs = []
    for name, value in values.items():
        if isinstance(value, np.ndarray):  # sent as it is, in its own type
            array = value
        else:
            array = np.array([v.encode() if isinstance(v, str) else v for v in
                              (value if isinstance(value, list) else [value])], dtype=NUMPY_TYPES[types[name]])
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def grpc_stream(s, cancel_after: int | None = None, times: list | None = None, **values) -> list:
    """One request over a gRPC stream; the responses up to the final one (or the error).
    cancel_after: cancel the stream once that many responses have arrived; times: gets each
    response's arrival time."""
    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(s.grpc)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("trtssd", _grpc_inputs(**values), enable_empty_final_response=True)
        responses = []
        while True:
            result, error = got.get(timeout=120)
            if times is not None:
                times.append(time.monotonic())
            if error is not None:
                responses.append(error)
                return responses
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses
            if cancel_after is not None and len(responses) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return responses
    finally:
        client.stop_stream()
        client.close()


def _joined(responses) -> tuple[str, list[int]]:
    text = "".join(r.as_numpy("text_output")[0].decode() for r in responses)
    return text, [int(t) for r in responses for t in r.as_numpy("output_ids")]


def _metric(s, name: str, **labels) -> float:
    with httpx.Client(base_url=s.metrics, timeout=10) as client:
        return scrape(client, name, **labels)


@server_test
def test_server_reports_the_decoupled_model(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http.removeprefix("http://"))
    assert client.is_server_ready() and client.is_model_ready("trtssd")
    config = client.get_model_config("trtssd")
    assert config["model_transaction_policy"]["decoupled"] and config["max_batch_size"] == 0
    metadata = client.get_model_metadata("trtssd")
    assert {t["name"] for t in metadata["inputs"]} == {s.name for s in INPUTS}
    assert {t["name"] for t in metadata["outputs"]} == {s.name for s in OUTPUTS}


@server_test
def test_concurrent_greedy_streams_equal_ar_token_for_token(server, reference):
    times = {p: [] for p in PROMPTS}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        runs = list(pool.map(lambda p: grpc_stream(server, times=times[p], text_input=p, stream=True, temperature=0.0,
                                                   max_tokens=GREEDY_TOKENS), PROMPTS))
    # Batched together, not one after another: every stream had its first tokens before any ended.
    assert max(t[0] for t in times.values()) < min(t[-1] for t in times.values())
    for prompt, responses in zip(PROMPTS, runs):
        text, ids = _joined(responses)
        assert ids == reference.outputs[prompt].token_ids, prompt
        assert text == reference.outputs[prompt].text, prompt
        assert sum(1 for r in responses if r.as_numpy("text_output")[0]) > 1  # incremental, not all at the end
        last = responses[-1]
        assert last.as_numpy("finish_reason")[0].decode() == reference.outputs[prompt].finish_reason
        assert last.as_numpy("num_output_tokens")[0] == len(ids)
        assert last.as_numpy("num_input_tokens")[0] > 0
        assert last.as_numpy("total_draft_tokens")[0] > 0  # ssd speculated
    assert _metric(server, "vllm:spec_decode_num_drafts_total") > 0


@server_test
def test_http_generate_and_generate_stream(server, reference):
    prompt = PROMPTS[0]
    ref = reference.outputs[prompt]
    with httpx.Client(base_url=server.http, timeout=120) as client:
        r = client.post("/v2/models/trtssd/generate",
                        json={"text_input": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == prompt + ref.text  # vLLM's rule: the prompt first unless excluded
        r = client.post("/v2/models/trtssd/generate",
                        json={"text_input": prompt, "exclude_input_in_output": True,
                              "parameters": {"max_tokens": GREEDY_TOKENS, "temperature": 0}})
        assert r.json()["text_output"] == ref.text
        # The body `vllm bench serve --backend tensorrt-llm` sends (accumulate_tokens is ignored).
        body = {"accumulate_tokens": True, "text_input": prompt, "temperature": 0.0, "top_p": 1.0,
                "max_tokens": GREEDY_TOKENS, "stream": True}
        events = []
        with client.stream("POST", "/v2/models/trtssd/generate_stream", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))
    assert len([e for e in events if e["text_output"]]) > 1
    assert "".join(e["text_output"] for e in events) == ref.text
    assert events[-1]["finish_reason"] == ref.finish_reason


@server_test
def test_sampling_parameters_are_honoured(server, reference):
    prompt = PROMPTS[1]
    seeded = dict(text_input=prompt, **SEEDED)
    first = _joined(grpc_stream(server, **seeded))
    again = _joined(grpc_stream(server, **seeded))
    as_json = _joined(grpc_stream(server, text_input=prompt, sampling_parameters=json.dumps(
        {"temperature": "0.9", "top_p": "0.95", "seed": "1234", "max_tokens": "12", "ignore_eos": True})))
    assert first == again == as_json  # a seed repeats its output, whichever way it is given
    assert len(first[1]) == 12
    # A stop string ends the output as it ends LLM.generate's (the stop string itself left out).
    responses = grpc_stream(server, text_input=PROMPTS[0], temperature=0.0, max_tokens=GREEDY_TOKENS,
                            stop_words=[reference.stop], exclude_input_in_output=True)
    assert _joined(responses) == (reference.stopped.text, reference.stopped.token_ids)
    assert responses[-1].as_numpy("finish_reason")[0] == b"stop"
    ref = reference.outputs[PROMPTS[0]]
    short = grpc_stream(server, text_input=PROMPTS[0], temperature=0.0, max_tokens=3)
    assert _joined(short)[1] == ref.token_ids[:3] and short[-1].as_numpy("finish_reason")[0] == b"length"


def _log_probs(responses) -> tuple[list[float], list[float]]:
    """A request's output_log_probs joined over its responses, and each response's cum_log_probs."""
    for r in responses:  # TensorRT-LLM's shapes less the batch: [beams = 1, tokens] and [1]
        assert r.as_numpy("output_log_probs").shape == (1, len(r.as_numpy("output_ids")))
        assert r.as_numpy("cum_log_probs").shape == (1,)
    return ([float(v) for r in responses for v in r.as_numpy("output_log_probs")[0]],
            [float(r.as_numpy("cum_log_probs")[0]) for r in responses])


def _check_log_probs(responses, want) -> list[float]:
    """output_log_probs are ``want``'s values and every cum_log_probs is the sum up to its response."""
    values, cums = _log_probs(responses)
    assert values == pytest.approx([e.logprob for e in want], abs=LOGPROB_TOL)
    sizes = [len(r.as_numpy("output_ids")) for r in responses]
    assert cums == pytest.approx([sum(values[:sum(sizes[:i + 1])]) for i in range(len(sizes))], abs=1e-5)
    return values


@server_test
def test_log_probs_are_the_offline_ones_streamed_or_not(server, reference, sampled_reference):
    greedy = reference.outputs[PROMPTS[0]]
    sampled = sampled_reference
    runs = {}
    for stream in (True, False):
        responses = grpc_stream(server, text_input=PROMPTS[0], stream=stream, temperature=0.0,
                                max_tokens=GREEDY_TOKENS, return_log_probs=True)
        assert _joined(responses)[1] == greedy.token_ids
        runs["greedy", stream] = _check_log_probs(responses, greedy.logprobs)
        if stream:
            assert len(responses) > 2  # several rounds, then the closing response (no tokens, the total)
        responses = grpc_stream(server, text_input=PROMPTS[1], stream=stream, return_log_probs=True, **SEEDED)
        assert _joined(responses)[1] == sampled.token_ids  # the seed's promise, so the values are comparable
        runs["sampled", stream] = _check_log_probs(responses, sampled.logprobs)
    for kind in ("greedy", "sampled"):
        assert runs[kind, True] == pytest.approx(runs[kind, False], abs=LOGPROB_TOL)
    # Without the flag neither output is sent.
    plain = grpc_stream(server, text_input=PROMPTS[0], stream=True, temperature=0.0, max_tokens=3)
    assert all(r.as_numpy(name) is None for r in plain for name in LOG_PROB_OUTPUTS)


@server_test
def test_http_generate_returns_log_probs(server, reference):
    ref = reference.outputs[PROMPTS[0]]
    want = [e.logprob for e in ref.logprobs]
    body = {"text_input": PROMPTS[0], "max_tokens": GREEDY_TOKENS, "temperature": 0, "return_log_probs": True}
    with httpx.Client(base_url=server.http, timeout=120) as client:
        r = client.post("/v2/models/trtssd/generate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert np.ravel(out["output_log_probs"]).tolist() == pytest.approx(want, abs=LOGPROB_TOL)
        assert out["cum_log_probs"] == pytest.approx(sum(np.ravel(out["output_log_probs"])), abs=1e-5)
        events = []
        with client.stream("POST", "/v2/models/trtssd/generate_stream", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
        streamed = [v for e in events for v in np.ravel(e["output_log_probs"]).tolist()]
        assert streamed == pytest.approx(want, abs=LOGPROB_TOL)
        assert events[-1]["cum_log_probs"] == pytest.approx(sum(streamed), abs=1e-5)
        plain = client.post("/v2/models/trtssd/generate", json={**body, "return_log_probs": False}).json()
        assert not set(LOG_PROB_OUTPUTS) & set(plain)


@server_test
def test_bad_inputs_get_errors_and_the_server_stays_ready(server):
    from tritonclient.utils import InferenceServerException

    bad = [
        ({"text_input": "hi", "temperature": -1}, "SamplingParams.temperature"),
        ({"text_input": "hi", "sampling_parameters": "{nope"}, "not valid JSON"),
        ({"text_input": "hi", "sampling_parameters": '{"beam_width": 4}'}, "unknown key(s)"),
        ({"text_input": "hi", "max_tokens": 10 * MAX_SEQ_LEN}, "exceeds max_model_len"),
        ({"text_input": "hi", "stream": True, "exclude_input_in_output": False}, "not allowed"),
        ({"max_tokens": 4}, "text_input"),  # Triton's own check of a required input
        ({"text_input": "hi", "sampling_parameters": '{"logprobs": 21}'}, "SamplingParams.logprobs"),
    ]
    with httpx.Client(base_url=server.http, timeout=60) as client:
        for body, message in bad:
            r = client.post("/v2/models/trtssd/generate", json=body)
            assert r.status_code == 400 and message in r.json()["error"], (body, r.text)
    [error] = grpc_stream(server, text_input="hi", top_p=0.0)
    assert isinstance(error, InferenceServerException) and "SamplingParams.top_p" in error.message()
    # A non-boolean flag: Triton checks the declared type before the model sees the request. (Over
    # HTTP generate, Triton's JSON parser answers a non-boolean with a 500 that names no input.)
    [error] = grpc_stream(server, text_input="hi", return_log_probs=np.array([1], dtype=np.int32))
    assert isinstance(error, InferenceServerException) and "return_log_probs" in error.message()
    assert httpx.get(f"{server.http}/v2/health/ready").status_code == 200
    ok = grpc_stream(server, text_input=PROMPTS[0], temperature=0.0, max_tokens=2)
    assert len(_joined(ok)[1]) == 2


@server_test
def test_num_return_sequences_gives_each_sample_its_responses(server, reference):
    """TensorRT-LLM's num_return_sequences: every response names its sample in sequence_index;
    streamed, each sample's rounds then its closing response (the last one FINAL); without
    streaming one whole response per sample. Greedy samples each equal the single request."""
    ref = reference.outputs[PROMPTS[0]]
    greedy = dict(text_input=PROMPTS[0], temperature=0.0, max_tokens=GREEDY_TOKENS, num_return_sequences=3)
    responses = grpc_stream(server, stream=True, **greedy)
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in responses]
    assert finals == [False] * (len(responses) - 1) + [True]  # one FINAL response: the request's last
    by_sample = {}
    for r in responses:
        by_sample.setdefault(int(r.as_numpy("sequence_index")[0]), []).append(r)
    assert sorted(by_sample) == [0, 1, 2]
    for mine in by_sample.values():
        assert _joined(mine) == (ref.text, ref.token_ids)
        closing = [r for r in mine if r.as_numpy("finish_reason")[0]]
        assert len(closing) == 1 and closing[0] is mine[-1]  # each sample's stream ends with its own closing
        assert mine[-1].as_numpy("num_output_tokens")[0] == len(ref.token_ids)
    whole = grpc_stream(server, exclude_input_in_output=True, **greedy)
    assert sorted(int(r.as_numpy("sequence_index")[0]) for r in whole) == [0, 1, 2]
    assert all(_joined([r]) == (ref.text, ref.token_ids) for r in whole)
    [error] = grpc_stream(server, text_input="hi", num_return_sequences=5)  # above the model's max_batch 4
    assert "'num_return_sequences'" in error.message() and "exceeds max_batch 4" in error.message()
    [error] = grpc_stream(server, text_input="hi", num_return_sequences=0)
    assert "'num_return_sequences'" in error.message()


@server_test
def test_a_cancelled_stream_frees_its_rows(server):
    aborted = _metric(server, "vllm:request_success_total", finished_reason="abort")
    # gRPC: the client cancels its stream after the first response.
    responses = grpc_stream(server, cancel_after=1, text_input=PROMPTS[2], stream=True, temperature=0.0,
                            max_tokens=200, ignore_eos=True)
    assert len(responses) == 1
    _wait_for(lambda: _metric(server, "vllm:request_success_total", finished_reason="abort") == aborted + 1)
    # HTTP: the client of a generate_stream goes away after the first event.
    with httpx.Client(base_url=server.http, timeout=60) as client:
        with client.stream("POST", "/v2/models/trtssd/generate_stream",
                           json={"text_input": PROMPTS[2], "max_tokens": 200, "ignore_eos": True, "stream": True,
                                 "temperature": 0.0}) as response:
            next(line for line in response.iter_lines() if line.startswith("data: "))
    _wait_for(lambda: _metric(server, "vllm:request_success_total", finished_reason="abort") == aborted + 2)
    _wait_for(lambda: _metric(server, "vllm:num_requests_running") == 0)  # rows freed long before 200 tokens
    assert _joined(grpc_stream(server, text_input=PROMPTS[0], temperature=0.0, max_tokens=2))[1]


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


@server_test
def test_metrics_port_has_triton_and_speculation_metrics(server):
    assert _metric(server, "nv_inference_request_success", model="trtssd") > 0
    assert _metric(server, "vllm:request_success_total", finished_reason="length") > 0
    assert _metric(server, "vllm:spec_decode_num_draft_tokens_total") > 0
    assert _metric(server, "vllm:time_to_first_token_seconds_count") > 0
    assert _metric(server, "trtssd:spec_decode_cache_hits_total") + \
        _metric(server, "trtssd:spec_decode_cache_misses_total") > 0


@server_test
def test_stopping_the_server_leaves_nothing_behind(server):
    """Last: SIGINT to `trtssd triton-serve` stops Triton, the model, its draft rank, and their
    shared memory, all by themselves (the cleanup of leftovers has nothing to do)."""
    processes, segments = _segments_and_processes(server.process.pid)
    assert len(processes) >= 4  # triton-serve, tritonserver, the model's stub, the draft rank (and helpers)
    assert any(s.startswith("trtssd-") for s in segments) and any(s.startswith("mpich_shm_") for s in segments)
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(120) == 0
    alive = [pid for pid, start in processes.items() if start_time(pid) == start]
    assert not alive
    assert not [s for s in segments if os.path.exists(f"/dev/shm/{s}")]
    log = server.log.read_text()
    assert "outlived" not in log and "removed shared memory" not in log, log[-3000:]
