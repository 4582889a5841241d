"""AsyncLLM without HTTP: TargetLoop.abort, AsyncLLM streams, aborts, the bounded
queue, a dying loop, and Prometheus counters against the requests served (tiny models, the draft
in this process)."""

from __future__ import annotations

import asyncio

import pytest

from trtssd import LLM, ModelRef, SamplingParams
from trtssd.serving.async_llm import AsyncLLM, LoopStopped, Overloaded
from trtssd.serving.prometheus_metrics import ServerMetrics

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12, [3, 1, 4, 1, 5, 9, 2, 6], [42], [5, 6] * 5]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _llm(tiny_pair, mode: str = "ssd", **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    return LLM(target=ModelRef(str(tiny_pair[0])), draft=ModelRef(str(tiny_pair[1])), mode=mode, launch="local",
               plain_under_load=False, **kw)


@pytest.fixture(scope="module")
def reference(tiny_pair) -> list[list[int]]:
    with _llm(tiny_pair, "ar") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


# --- TargetLoop.abort ----------------------------------------------------------------------------

def test_abort_frees_waiting_and_running_requests_on_both_ranks(tiny_pair, reference, queue):
    with _llm(tiny_pair, max_batch=2) as llm:
        loop, worker = llm.loop, llm.loop.draft.server.worker
        ids = [queue(loop, p, SamplingParams(temperature=0, max_tokens=60)) for p in PROMPTS[:3]]
        loop.step()  # admits two (prefill), the third waits
        loop.step()  # one speculative round
        assert [s.seq_id for s in loop.scheduler.running] == ids[:2] and [s.seq_id for s in loop.scheduler.waiting] == ids[2:]
        waiting = loop.abort(ids[2])
        assert waiting.finish_reason == "abort" and not loop.scheduler.waiting
        running = loop.abort(ids[0])
        assert running.finish_reason == "abort" and running.output and [s.seq_id for s in loop.scheduler.running] == ids[1:2]
        assert loop.abort(ids[0]) is None and loop.abort(999) is None
        loop.step()  # the next round tells the draft
        assert ids[0] not in worker.seqs and ids[0] not in worker.cache
        # Its target row is free again: two new requests fit beside the one still running.
        more = [queue(loop, p, GREEDY) for p in PROMPTS[3:5]]
        loop.abort(ids[1])
        while loop.has_unfinished():
            loop.step()
        assert [loop.pop_finished(i).output for i in more] == reference[3:5]
        assert not worker.seqs  # nothing left anywhere: the last Release went out when idle


def test_abort_when_nothing_else_runs_releases_the_draft_at_once(tiny_pair, queue):
    with _llm(tiny_pair) as llm:
        loop = llm.loop
        seq_id = queue(loop, PROMPTS[0], GREEDY)
        loop.step()
        loop.step()
        assert seq_id in loop.draft.server.worker.seqs
        loop.abort(seq_id)
        assert not loop.draft.server.worker.seqs and not loop.has_unfinished()


# --- AsyncLLM ---------------------------------------------------------------------------------

async def _collect(stream) -> tuple[list[int], object]:
    tokens = []
    async for delta in stream:
        tokens += delta.token_ids
    return tokens, stream.final


def test_requests_join_a_running_loop_and_stream_exact_output(tiny_pair, reference):
    records = []
    with _llm(tiny_pair, max_batch=2) as llm:
        served = AsyncLLM(llm, on_finished=records.append).start()

        async def main():
            first = served.submit(PROMPTS[0], GREEDY)
            await asyncio.sleep(0.05)  # the loop is busy with the first when the rest arrive
            rest = [served.submit(p, GREEDY) for p in PROMPTS[1:]]
            return await asyncio.gather(*(_collect(s) for s in [first] + rest))

        results = asyncio.run(main())
        served.shutdown()
        assert not served.alive and not llm.loop.has_unfinished()
    for (tokens, final), ref in zip(results, reference):
        assert tokens == list(final.token_ids) == ref
        assert final.finish_reason == "length" and final.usage["completion_tokens"] == len(ref)
        assert final.ttft_s > 0 and final.e2e_s >= final.ttft_s and final.speculation.num_drafts > 0
    assert sorted(r.request_id for r in records) == sorted(f.request_id for _, f in results)


def test_a_steps_outputs_wake_the_event_loop_once(tiny_pair, reference):
    """Every output of one step (several requests' tokens, their finished records) reaches the
    requests' event loop in one wake-up, in order: the loop thread pays one pipe write a step,
    not one an output."""
    with _llm(tiny_pair, "ar", max_batch=4) as llm:
        served = AsyncLLM(llm).start()
        outputs_per_step = []
        step = served.loop.step
        served.loop.step = lambda: outputs_per_step.append(len(out := step())) or out

        async def main():
            event_loop, wakes = asyncio.get_running_loop(), []
            wake = event_loop.call_soon_threadsafe
            event_loop.call_soon_threadsafe = lambda *args: wakes.append(1) or wake(*args)
            streams = [served.submit(p, GREEDY) for p in PROMPTS[:4]]
            return await asyncio.gather(*(_collect(s) for s in streams)), len(wakes)

        results, wakes = asyncio.run(main())
        served.shutdown()
    assert [tokens for tokens, _ in results] == reference[:4]
    assert wakes == sum(1 for n in outputs_per_step if n) < sum(outputs_per_step)


def test_an_aborted_stream_ends_with_abort_and_frees_its_rows(tiny_pair):
    with _llm(tiny_pair) as llm:
        served = AsyncLLM(llm).start()

        async def main():
            stream = served.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200))
            seen = 0
            async for delta in stream:
                seen += len(delta.token_ids)
                if seen >= 3:
                    stream.abort()
            return stream.final

        final = asyncio.run(main())
        served.shutdown()
        assert final.finish_reason == "abort" and 3 <= final.completion_tokens < 200
        assert not llm.loop.scheduler.running and not llm.loop.draft.server.worker.seqs


def test_a_full_queue_is_refused_as_overloaded(tiny_pair):
    with _llm(tiny_pair, max_batch=1) as llm:
        served = AsyncLLM(llm, max_waiting=1).start()

        async def main():
            long = SamplingParams(temperature=0, max_tokens=150)
            streams = [served.submit(PROMPTS[0], long), served.submit(PROMPTS[1], long)]
            with pytest.raises(Overloaded, match="max_batch 1 running \\+ max_waiting 1 queued"):
                served.submit(PROMPTS[2], long)
            for s in streams:
                s.abort()
            await asyncio.gather(*(s.result() for s in streams))
            return await served.submit(PROMPTS[2], SamplingParams(temperature=0, max_tokens=3)).result()

        assert asyncio.run(main()).completion_tokens == 3  # room again once the others left
        served.shutdown()


def test_a_failing_loop_fails_every_pending_request_and_refuses_new_ones(tiny_pair):
    with _llm(tiny_pair, max_batch=2) as llm:
        served = AsyncLLM(llm).start()
        step, calls = llm.loop.step, []

        def failing():
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("injected loop failure")
            return step()

        llm.loop.step = failing

        async def main():
            streams = [served.submit(p, SamplingParams(temperature=0, max_tokens=100)) for p in PROMPTS[:3]]
            for s in streams:
                with pytest.raises(LoopStopped, match="injected loop failure"):
                    await s.result()
            with pytest.raises(LoopStopped, match="injected loop failure"):
                served.submit(PROMPTS[0], GREEDY)

        asyncio.run(main())
        assert not served.alive and "injected loop failure" in served.failure


def test_prometheus_counters_equal_the_served_requests(tiny_pair):
    """Counted once per finished request, from its own SpeculationMetrics."""
    with _llm(tiny_pair, max_batch=3) as llm:
        metrics = ServerMetrics("tiny", k=llm.spec.k)
        records = []

        def observe(record):
            records.append(record)
            metrics.observe(record)

        served = AsyncLLM(llm, on_finished=observe).start()
        metrics.track(served)
        params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=17),
                  SamplingParams(temperature=0, max_tokens=9, stop_token_ids=(7,))]

        async def main():
            streams = [served.submit(p, sp) for p, sp in zip(PROMPTS[:3] * 2, params * 2)]
            await asyncio.gather(*(s.result() for s in streams))

        asyncio.run(main())
        served.shutdown()
        value = _sample_reader(metrics)
        assert value("vllm:num_requests_running") == value("vllm:num_requests_waiting") == 0
        assert value("trtssd:draft_degraded") == 0

    spec = [r.speculation for r in records]
    assert value("vllm:generation_tokens_total") == sum(r.completion_tokens for r in records)
    assert value("vllm:prompt_tokens_total") == sum(r.prompt_tokens for r in records)
    for reason in ("length", "stop"):
        assert value("vllm:request_success_total", finished_reason=reason) == sum(r.finish_reason == reason
                                                                                 for r in records)
    assert value("vllm:spec_decode_num_drafts_total") == sum(m.num_drafts for m in spec) > 0
    assert value("vllm:spec_decode_num_draft_tokens_total") == sum(m.num_draft_tokens for m in spec)
    accepted = value("vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == sum(m.num_accepted_tokens for m in spec)
    assert accepted == sum(value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                           for i in range(llm.spec.k))
    assert value("trtssd:spec_decode_cache_hits_total") == sum(m.cache_hits for m in spec)
    assert value("trtssd:spec_decode_cache_misses_total") == sum(m.cache_misses for m in spec)
    for kind in ("neural", "fast"):
        assert value("trtssd:spec_decode_backups_total", kind=kind) == sum(getattr(m, f"{kind}_backups") for m in spec)
    assert value("trtssd:spec_decode_tree_branches_total") == sum(m.tree_branches for m in spec)
    assert value("vllm:time_to_first_token_seconds_count") == value("vllm:e2e_request_latency_seconds_count") == 6
    assert value("vllm:inter_token_latency_seconds_count") == sum(len(r.token_gaps_s) for r in records)


def _sample_reader(metrics: ServerMetrics):
    def value(name: str, **labels) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels}) or 0.0

    return value
