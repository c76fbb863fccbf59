"""AsyncLLM: streaming kinds, abort and cancellation, many concurrent requests, engine death."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from conftest import long_context_llama
from frontend import LLM, AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def engine(llama_model):
    engine = AsyncLLM(llama_model, dtype="float32", max_num_seqs=128)
    yield engine
    engine.shutdown()


def run(coroutine):
    return asyncio.run(coroutine)


async def _collect(engine: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    return [output async for output in engine.generate(prompt, params, request_id)]


def test_stream_kinds_agree_with_llm(engine, llama_model):
    prompt = "Once upon a time"
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["e t", "xyz"])

    async def stream_all():
        return await asyncio.gather(*[
            _collect(engine, prompt, SamplingParams(**base, output_kind=kind), f"kind-{kind.value}")
            for kind in RequestOutputKind])

    cumulative, delta, final_only = run(stream_all())
    [expected] = LLM(llama_model, dtype="float32", in_process=True).generate(prompt, SamplingParams(**base),
                                                                            use_tqdm=False)
    expected = expected.outputs[0]
    for stream in (cumulative, delta, final_only):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        assert stream[-1].outputs[0].finish_reason == expected.finish_reason
    assert len(final_only) == 1 and final_only[0].outputs[0].text == expected.text
    assert cumulative[-1].outputs[0].text == expected.text
    assert cumulative[-1].outputs[0].token_ids == expected.token_ids
    assert "".join(o.outputs[0].text for o in delta) == expected.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == expected.token_ids
    texts = [o.outputs[0].text for o in cumulative]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))  # nothing shown is retracted


def test_abort_ends_the_stream_with_one_final_output(engine):
    async def scenario():
        params = SamplingParams(max_tokens=10_000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        outputs = []
        async for output in engine.generate("abort me", params, "to-abort"):
            outputs.append(output)
            if len(outputs) == 3:
                await engine.abort("to-abort")
        stats = await engine.get_stats()
        return outputs, stats

    outputs, stats = run(scenario())
    assert [o.finished for o in outputs] == [False, False, False, True]
    assert outputs[-1].outputs[0].finish_reason == "abort"
    assert stats.num_running == 0 and stats.num_free_blocks == engine.info.num_kv_blocks


def test_bad_requests_fail_their_stream_only(engine):
    async def scenario():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(engine, {"prompt_token_ids": [1, 10**6]}, SamplingParams(), "bad")
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(_collect(engine, "twin", SamplingParams(max_tokens=50), "twin"),
                                 _collect(engine, "twin", SamplingParams(max_tokens=50), "twin"))
        return await _collect(engine, "fine", SamplingParams(max_tokens=3, ignore_eos=True), "fine")

    assert len(run(scenario())[-1].outputs[0].token_ids) == 3


def test_thousand_concurrent_streams_with_200_cancelled(engine):
    num_requests, cancelled = 1000, set(range(0, 1000, 5))

    started = {i: asyncio.Event() for i in cancelled}

    async def consume(i: int) -> list:
        # A cancelled request must still be running when its cancel reaches the engine (a finished one is not
        # aborted): it may run to the tiny llama's whole context, longer than any cancel takes under load.
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=1000 if i in cancelled else 6, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        outputs = []
        async for output in engine.generate({"prompt_token_ids": [5 + i % 50, 7, 9]}, params, f"req-{i}"):
            outputs.append(output)
            if i in started:
                started[i].set()
        return outputs

    async def scenario():
        before = (await engine.get_stats()).num_aborted_requests
        tasks = {i: asyncio.create_task(consume(i)) for i in range(num_requests)}

        async def cancel_mid_stream(i: int) -> None:
            await started[i].wait()
            tasks[i].cancel()

        await asyncio.gather(*(cancel_mid_stream(i) for i in cancelled))
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        while (stats := await engine.get_stats()).num_running or stats.num_waiting:
            await asyncio.sleep(0.05)
        return before, dict(zip(tasks, results)), stats

    before, results, stats = run(scenario())
    for i, result in results.items():
        if i in cancelled:
            assert isinstance(result, asyncio.CancelledError), (i, result)
        else:
            assert [o.finished for o in result] == [False] * (len(result) - 1) + [True], i
            assert sum(len(o.outputs[0].token_ids) for o in result) == 6
    assert stats.num_aborted_requests - before == len(cancelled)
    assert stats.num_free_blocks == engine.info.num_kv_blocks
    assert not engine.router.groups and not engine.router.children and not engine.router.output_processor.states


def test_engine_death_fails_every_stream_within_a_second():
    # The 64k-context llama: on the 1k one the eight requests could reach its context, and end, before the kill.
    engine = AsyncLLM(long_context_llama(), dtype="float32")

    async def scenario():
        params = SamplingParams(max_tokens=10_000, ignore_eos=True)
        streams = [engine.generate("x", params, f"r{i}") for i in range(8)]
        firsts = [await anext(stream) for stream in streams]
        os.kill(engine.client.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        elapsed = time.monotonic() - killed_at
        with pytest.raises(EngineDeadError):
            await anext(engine.generate("later", params, "later"))
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        return firsts, elapsed

    firsts, elapsed = run(scenario())
    assert all(not o.finished for o in firsts) and elapsed < 1.0
    assert engine.errored
    engine.shutdown()
