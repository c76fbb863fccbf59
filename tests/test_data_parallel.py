"""Data parallel (issue 55, first increment): two engine cores behind one front end. Routing by prefix, by
conversation and by load (frontend/dp_balance.py); greedy outputs equal one engine's, offline and through AsyncLLM;
kill -9 of one engine fails its own requests at once while the other's finish, and health names it."""
from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import time

import httpx
import msgspec
import openai
import psutil
import pytest

from conftest import assert_all_blocks_free, child_pids, long_context_llama, tiny_model, wait_until
from frontend import LLM, AsyncLLM, SamplingParams
from core.engine_spawn import EngineProcess, data_parallel_configs
from frontend.api.metrics import ServerMetrics
from frontend.core_client import EngineDeadError, RequestFailedError
from frontend.dp_balance import OVERLOAD_ABSOLUTE, EngineBalancer
from ipc import EngineConfig, EngineCoreRequest, RequestOutputKind
from launcher import descendants, start_launcher, stop_launcher

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Four shared prefixes of three 16-token blocks, four requests each, interleaved.
PREFIXES = [[(7 * p + i) % 500 + 1 for i in range(48)] for p in range(4)]
PROMPTS = [{"prompt_token_ids": PREFIXES[i % 4] + [600 + i, 3, 5]} for i in range(16)]


def request(request_id: str, ids: list[int], cache_salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=SamplingParams(),
                             cache_salt=cache_salt)


def test_new_prefixes_spread_over_idle_engines():
    """Nothing in flight anywhere: each new prefix goes to the engine this front end has sent the fewest blocks."""
    balancer = EngineBalancer(2, block_size=4)
    engines = []
    for n in range(4):
        engines.append(balancer.choose(request(f"p{n}", [100 * n + i for i in range(1, 9)])))
        balancer.finished(f"p{n}")
    assert sorted(engines) == [0, 0, 1, 1] and balancer.blocks_sent == [4, 4]


def test_a_prefix_keeps_its_engine_until_it_is_overloaded():
    balancer = EngineBalancer(2, block_size=4)
    shared = list(range(1, 13))
    first = balancer.choose(request("a", shared + [50]))
    assert balancer.choose(request("b", [90, 91, 92, 93, 94])) != first  # the lighter one
    assert balancer.choose(request("c", shared + [60])) == first  # its blocks went there
    assert balancer.choose(request("d", shared[:4] + [70] * 8)) == first  # one block in common is enough
    for n in range(OVERLOAD_ABSOLUTE + 2):  # until it holds more than the absolute and relative slack
        engine = balancer.choose(request(f"x{n}", shared + [n]))
    assert engine != first and balancer.load_routed >= 2
    for request_id in list(balancer.owner):
        balancer.finished(request_id)
    assert balancer.load == [0, 0] and not balancer.owner


def test_a_conversation_keeps_its_engine_and_a_dead_engine_takes_nothing():
    balancer = EngineBalancer(3, block_size=4)
    engine = balancer.choose(request("a", [1, 2, 3], cache_salt="user-7"))
    assert {balancer.choose(request(f"b{n}", [9, n, 4], cache_salt="user-7")) for n in range(3)} == {engine}
    assert sorted(balancer.engine_died(engine)) == ["a", "b0", "b1", "b2"]
    assert balancer.choose(request("c", [1, 2, 3], cache_salt="user-7")) != engine
    rounds = EngineBalancer(2, block_size=4, policy="round_robin")
    assert [rounds.choose(request(f"r{n}", list(range(8)))) for n in range(4)] == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="data_parallel_routing must be one of"):
        EngineConfig(model="unused", data_parallel_routing="random")


def test_other_front_ends_requests_weigh_as_this_ones():
    balancer = EngineBalancer(2, block_size=4)
    shared = list(range(1, 13))
    first = balancer.choose(request("a", shared + [1]))
    balancer.others[1 - first] = 3
    assert balancer.choose(request("b", [90, 91])) == first  # 1 + 0 against 0 + 3
    balancer.others[first] = OVERLOAD_ABSOLUTE + 5  # another front end's requests make the prefix's engine overloaded
    assert balancer.choose(request("c", shared + [2])) == 1 - first
    assert balancer.load[first] == 2 and balancer.weight(first) == 2 + OVERLOAD_ABSOLUTE + 5


def test_a_killed_engines_leftover_processes_end_with_it():
    """What an engine started in its session (a private Ray cluster's agents, here a shell's sleep) outlives a kill -9
    of the engine, reparented to init: end_group ends it once the engine has exited, and never while it runs."""
    engine = object.__new__(EngineProcess)
    engine.process = subprocess.Popen(["bash", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                                      start_new_session=True)
    leftover = int(engine.process.stdout.readline())
    engine.end_group()  # alive: nothing is killed
    assert engine.is_alive()
    os.kill(engine.pid, signal.SIGKILL)
    engine.process.wait()
    os.kill(leftover, 0)  # the sleep outlived its shell
    engine.end_group()
    assert wait_until(lambda: not psutil.pid_exists(leftover) or psutil.Process(leftover).status() == "zombie",
                      timeout=5)


def test_each_engine_pins_its_threads_to_its_own_share_of_the_cpus():
    def binds(config: EngineConfig, cpus: list[int]) -> list[str | None]:
        return [engine.cpu_threads_bind for engine in data_parallel_configs(config, cpus)]

    config = EngineConfig(model="unused", data_parallel_size=2)
    assert binds(config, [0, 1, 2, 3, 4]) == ["0,1", "2,3"]
    assert binds(config, [3]) == [None, None]  # more engines than CPUs: the kernel places them
    assert binds(msgspec.structs.replace(config, cpu_threads=1), [0, 1, 2, 3]) == [None, None]


@functools.cache
def one_engines_outputs() -> tuple[list[list[int]], list[str]]:
    """PROMPTS' greedy tokens from one engine (the same alone or in any batch) and their decoded texts, for every
    test of the module."""
    single = LLM(tiny_model("llama"), dtype="float32")
    try:
        tokens = [output.outputs[0].token_ids for output in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return tokens, [single.tokenizer.decode(ids) for ids in tokens]
    finally:
        single.shutdown()


def test_two_engines_answer_as_one_offline_and_balance_by_prefix():
    expected = one_engines_outputs()[0]
    llm = LLM(tiny_model("llama"), dtype="float32", data_parallel_size=2)
    try:
        assert [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        per_engine = [client.get_stats() for client in llm.client.clients]
        assert all(stats.prefix_cache_queries > 0 for stats in per_engine)  # both served
        # Each prefix on one engine: every request after a prefix's first finds its 48 tokens.
        assert llm.get_stats().prefix_cache_hits == 12 * 48
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_async_streams_equal_and_a_killed_engine_fails_only_its_own_requests():
    async def run() -> None:
        engine = AsyncLLM(tiny_model("llama"), dtype="float32", data_parallel_size=2, data_parallel_routing="load")
        try:
            texts = await asyncio.gather(*(final(engine, f"s{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)))
            expected = one_engines_outputs()[0]
            assert [output.outputs[0].token_ids for output in texts] == expected
            # Eight long streams, four on each engine; engine 0 is killed once all have started.
            long = SamplingParams(max_tokens=1000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            started = [asyncio.Event() for _ in range(8)]
            streams = [asyncio.ensure_future(final(engine, f"l{i}", {"prompt_token_ids": [5 + i, 8, 9]}, long,
                                                   started[i])) for i in range(8)]
            await asyncio.gather(*(event.wait() for event in started))
            owners = dict(engine.client.balancer.owner)
            victim = engine.client.clients[0].process.pid
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.gather(*streams, return_exceptions=True)
            failed = [f"l{i}" for i, result in enumerate(results) if isinstance(result, RequestFailedError)]
            assert failed and sorted(failed) == sorted(rid for rid, owner in owners.items() if owner == 0)
            assert len(failed) == 4 and all(len(result.outputs[0].token_ids) == 1000 for result in results
                                            if not isinstance(result, Exception))
            assert max(failed_at.values()) - killed_at < 1.0
            with pytest.raises(EngineDeadError, match="engine core 0"):
                await engine.check_health()
            metrics = ServerMetrics("tiny").render(await engine.get_stats()).decode()
            assert 'engine_up{engine="0",model_name="tiny"} 0.0' in metrics  # its other series are gone
            assert 'running{engine="0",model_name="tiny"}' not in metrics
            assert 'running{engine="1",model_name="tiny"}' in metrics
            again = await final(engine, "after", PROMPTS[0], GREEDY)  # the other engine serves on
            assert again.outputs[0].token_ids == expected[0]
        finally:
            engine.shutdown()
        assert victim not in child_pids()

    asyncio.run(run())


failed_at: dict[str, float] = {}


async def final(engine: AsyncLLM, request_id: str, prompt, params: SamplingParams,
                started: asyncio.Event | None = None):
    """The request's last output, its tokens gathered over the stream (`started` set at its first output; when it
    fails, failed_at has the time)."""
    tokens, output = [], None
    try:
        async for output in engine.generate(prompt, params, request_id):
            tokens += output.outputs[0].token_ids if params.output_kind == RequestOutputKind.DELTA else []
            if started is not None:
                started.set()
    except RequestFailedError:
        failed_at[request_id] = time.monotonic()
        raise
    if params.output_kind == RequestOutputKind.DELTA:
        output.outputs[0].token_ids = tokens
    return output


def test_served_with_two_engines_a_killed_one_fails_health_while_the_other_serves():
    texts = one_engines_outputs()[1][:4]
    process, base_url = start_launcher([tiny_model("llama"), "--dtype", "float32", "--dp", "2",
                                        "--max-model-len", "256"])
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS[:4], texts):
            completion = client.completions.create(model=model, prompt=prompt["prompt_token_ids"], max_tokens=12,
                                                   temperature=0, extra_body={"ignore_eos": True})
            assert completion.choices[0].text == text
        engines = [pid for pid, command in descendants(process.pid) if "core.engine_process" in command]
        assert len(engines) == 2 and httpx.get(f"{base_url}/health").status_code == 200
        os.kill(engines[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (health := httpx.get(f"{base_url}/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.status_code == 503 and "engine core(s) 0 of 2 unavailable" in health.text
        for prompt, text in zip(PROMPTS[:4], texts):  # every prefix now goes to the engine that lives
            completion = client.completions.create(model=model, prompt=prompt["prompt_token_ids"], max_tokens=12,
                                                   temperature=0, extra_body={"ignore_eos": True})
            assert completion.choices[0].text == text
    finally:
        stop_launcher(process)
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in engines), timeout=10)


def test_a_front_end_steers_by_another_ones_load_and_metrics_label_each_engine():
    # long enough to run through the test on any machine (1,000 tokens of the 1k-context model did not on a fast one)
    long = SamplingParams(max_tokens=30_000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def until(condition, what: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    def counts(client) -> tuple[int, int]:
        """(requests the engine holds, of them this client's) from the engine's last heartbeat to the client."""
        beat = client.last_report
        return (-1, -1) if beat is None else (beat.num_waiting + beat.num_running, beat.num_yours)

    async def run() -> None:
        # A step per call and one request running per engine, the rest waiting: the engines stay loaded for
        # seconds however fast the machine.
        steered = AsyncLLM(long_context_llama(), dtype="float32", data_parallel_size=2, max_num_seqs=1,
                           num_scheduler_steps=1)
        loader = AsyncLLM(engine_address=[client.endpoints.input for client in steered.client.clients])
        streams = []
        try:
            await steered.check_health()  # subscribes to both engines' heartbeats
            await load_and_steer(steered, loader, streams)
            for engine in (0, 1):  # aborted, running or waiting: the engines hold none of either front end's
                await until(lambda: counts(loader.client.clients[engine]) == (0, 0), "the aborts are counted")
            stats = await steered.get_stats()
            assert stats.num_free_blocks == steered.info.num_kv_blocks and stats.num_running == stats.num_waiting == 0
        finally:
            loader.shutdown()
            steered.shutdown()

    async def load_and_steer(steered: AsyncLLM, loader: AsyncLLM, streams: list) -> None:
        try:
            # Six requests of one prefix from the other front end, all on one engine.
            streams += [asyncio.ensure_future(final(loader, f"a{i}", {"prompt_token_ids": PREFIXES[0] + [600 + i]},
                                                    long)) for i in range(6)]
            await until(lambda: len(loader.client.balancer.owner) == 6, "the loader's requests are sent")
            busy = loader.client.balancer.owner["a0"]
            assert set(loader.client.balancer.owner.values()) == {busy}
            await until(lambda: counts(steered.client.clients[busy]) == (6, 0), "the engine reports the six")
            await until(lambda: counts(loader.client.clients[busy]) == (6, 6), "and that they are the loader's")
            # By its own requests in flight both engines are empty to the steered front end; by the reports, not.
            streams += [asyncio.ensure_future(final(steered, f"b{i}", {"prompt_token_ids": [40 + i, 8, 9]}, long))
                        for i in range(4)]
            await until(lambda: len(steered.client.balancer.owner) == 4, "the steered requests are sent")
            assert set(steered.client.balancer.owner.values()) == {1 - busy}
            await until(lambda: counts(loader.client.clients[1 - busy]) == (4, 0), "the other engine reports four")

            text = ServerMetrics("tiny").render(await steered.get_stats()).decode()
            for engine, held in ((busy, 6), (1 - busy, 4)):
                labels = f'{{engine="{engine}",model_name="tiny"}}'
                running = float(text.split(f"pagedserve:num_requests_running{labels} ")[1].split()[0])
                waiting = float(text.split(f"pagedserve:num_requests_waiting{labels} ")[1].split()[0])
                assert (running, waiting) == (1, held - 1)
                assert f"vllm:num_requests_running{labels}" in text and f"pagedserve:engine_up{labels} 1.0" in text
            assert 'pagedserve:num_requests_running{model_name="tiny"}' not in text  # no unlabelled group series
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

    asyncio.run(run())
