"""The fast tier, ``pytest --fast`` (``bash scripts/test.sh --fast``): the tests that start no
process and download nothing, for the edit-test loop. The whole suite stays the test command.

What is left out is decided here, so no test file needs a mark of its own:

- tests marked ``slow``, ``mpi`` or ``gpu``;
- the modules in ``LEFT_OUT_MODULES`` (a peer server; statistical tests of many trials);
- tests using a fixture in ``PROCESS_FIXTURES`` (a build, a download, a process);
- tests that run long in-process (``LONG_TESTS``, more than about a second each on 2 cores: a
  function's name leaves out all its parameters, a full node id one of them).

A guard keeps the tier honest as tests are added: inside ``--fast``, a test that starts a process
(subprocess, fork, spawn) or connects to anything but this machine is skipped at that moment,
with the reason; add it to a list above (or mark it ``slow``) to leave it out before it runs.
"""

from __future__ import annotations

import ipaddress
import multiprocessing.util
import os
import socket
import subprocess

import pytest

LEFT_OUT_MARKERS = ("slow", "mpi", "gpu")

LEFT_OUT_MODULES = frozenset({
    "test_bench_llamacpp",  # starts llama-server
    "test_exactness",  # statistical: thousands of sampled trials against exact enumeration
})

PROCESS_FIXTURES = frozenset({
    "built",  # test_build: builds an engine, compiling the draft's kernels
    "smollm2",  # the default engine's tokenizer: fetches and builds the default engine on first use
    # test_transport: a writer process beside shared buffers; the guard's refusal would come after
    # the segment is made (Python's resource tracker starts at its registration) and leave it behind.
    "pair",
})

LONG_TESTS = frozenset({
    "tests/test_async_llm.py::test_abort_frees_waiting_and_running_requests_on_both_ranks",
    "tests/test_calibration.py::test_an_unreadable_calibration_is_timed_again_and_replaced",
    "tests/test_calibration.py::test_another_k_model_or_thread_count_times_again",
    "tests/test_calibration.py::test_deleting_the_cache_or_turning_it_off_times_again",
    "tests/test_calibration.py::test_the_second_start_does_not_time_again",
    "tests/test_draft_layers.py::test_fused_layers_match_torch_int4_layers",
    "tests/test_draft_layers.py::test_tree_branches_do_not_see_each_other",
    "tests/test_draft_worker.py::test_glue_on_a_hit_reuses_the_branch_and_matches_a_fresh_decode",
    "tests/test_draft_client.py::test_a_failing_draft_degrades_to_ar_without_losing_a_request",
    "tests/test_detokenizer.py::test_random_streams_join_to_the_full_decode[smollm2]",
    "tests/test_detokenizer.py::test_random_streams_with_stop_strings_match_the_full_decode[smollm2]",
    "tests/test_detokenizer.py::test_text_round_trips_with_whole_characters_per_delta[smollm2]",
    "tests/test_ggml_backend.py::test_a_full_cache_copies_at_most_two_cells_per_cell_its_compactions_free",
    "tests/test_ggml_backend.py::test_a_short_sequence_after_others_left_is_compacted_instead_of_padded",
    "tests/test_ggml_backend.py::test_long_chains_are_cut_and_aligned_the_same_way",
    "tests/test_ggml_backend.py::test_plain_decoding_on_borrowed_cores_keeps_rows_exact",
    "tests/test_ggml_backend.py::test_rows_bit_identical_in_verify_batch_and_tree",
    "tests/test_ggml_backend.py::test_rows_independent_of_threads_neighbours_and_cache_history",
    "tests/test_ggml_backend.py::test_tiny_gguf_greedy_equals_ar",
    "tests/test_load_control.py::test_load_control_times_rounds_without_the_caches_upkeep",
    "tests/test_prefix_cache.py::test_ggml_outputs_with_prefix_cache_and_chunks_equal_outputs_without",
    "tests/test_prefix_cache.py::test_ggml_prefix_saved_out_of_the_cache_and_loaded_back_equals_one_prefill_bit_for_bit",
    "tests/test_prefix_cache.py::test_ggml_prompt_continued_after_a_compaction_equals_one_prefill_bit_for_bit",
    "tests/test_prefix_cache.py::test_ggml_prompt_split_where_allowed_equals_one_prefill_bit_for_bit",
    "tests/test_prefix_cache.py::test_torch_outputs_with_prefix_cache_and_chunks_equal_outputs_without",
    "tests/test_prompt_logprobs.py::test_prompt_logprobs_match_offline_and_change_no_output",
    "tests/test_sampling.py::test_inverse_cdf_boundaries_are_exact_at_a_49k_vocabulary",
    "tests/test_k_per_round.py::test_greedy_output_equals_ar_while_k_changes_every_round",
    "tests/test_k_per_round.py::test_k_per_round_chooses_on_its_own_and_stays_exact",
    "tests/test_target_loop.py::test_a_seeded_request_gives_one_output_alone_in_a_batch_and_in_sd_or_ssd",
    "tests/test_target_loop.py::test_consecutive_seeds_are_independent",
    "tests/test_target_loop.py::test_joins_and_leaves_keep_greedy_output_and_release_everything",
    "tests/test_target_loop.py::test_verified_rows_are_the_rows_the_draft_sampled_from",
    "tests/test_tensor_parallel.py::test_one_way_split_is_the_plain_model",
    "tests/test_tensor_parallel.py::test_split_logits_equal_unsplit",
    "tests/test_tree_attention_triton.py::test_interpreter_matches_reference",
    "tests/test_verify.py::test_point_mass_proposals_against_a_truncated_target",
})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", default=False,
                     help="the fast tier: only tests that start no process and download nothing (tests/fast_tier.py)")


def _left_out(item: pytest.Item) -> bool:
    """Whether a test is outside the fast tier (see the module's docstring)."""
    if any(item.get_closest_marker(m) for m in LEFT_OUT_MARKERS):
        return True
    if item.module.__name__.rsplit(".", 1)[-1] in LEFT_OUT_MODULES:
        return True
    if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    return item.nodeid in LONG_TESTS or item.nodeid.split("[", 1)[0] in LONG_TESTS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--fast"):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if _left_out(item) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


_running: list[str] = [""]  # the test being set up or run, named in a refusal


def pytest_runtest_setup(item: pytest.Item) -> None:
    _running[0] = item.nodeid


def _refuse(what: str):
    """A stand-in for a call that starts a process: skips the running test, naming it and the call."""
    def refuse(*args, **kwargs):
        pytest.skip(f"{_running[0]} starts a process ({what}): outside the fast tier (tests/fast_tier.py)")
    return refuse


def _local_only(connect):
    """socket.connect that lets only loopback and Unix-socket addresses through."""
    def guarded(sock, address, *args, **kwargs):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            try:
                local = host == "localhost" or ipaddress.ip_address(host).is_loopback
            except ValueError:
                local = False
            if not local:
                pytest.skip(f"{_running[0]} connects to {host}: outside the fast tier (tests/fast_tier.py)")
        return connect(sock, address, *args, **kwargs)
    return guarded


@pytest.fixture(scope="session", autouse=True)
def fast_tier_guard(request: pytest.FixtureRequest):
    """Under ``--fast``: no process starts and no connection leaves this machine, in any test or
    fixture (session scope, so it is in place before every other fixture)."""
    if not request.config.getoption("--fast"):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess"))
        patch.setattr(os, "fork", _refuse("os.fork"))
        patch.setattr(os, "posix_spawn", _refuse("os.posix_spawn"))
        patch.setattr(os, "posix_spawnp", _refuse("os.posix_spawnp"))
        patch.setattr(multiprocessing.util, "spawnv_passfds", _refuse("multiprocessing spawn"))
        patch.setattr(socket.socket, "connect", _local_only(socket.socket.connect))
        yield
