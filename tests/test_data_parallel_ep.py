"""Data parallel attention with expert-parallel MoE (issue 55, item 4): the experts split over the engines, each MoE
layer exchanging tokens across them, the engines stepping in waves (core/waves.py). Greedy outputs equal one engine
without expert parallel; an idle engine keeps pace with dummy batches; kill -9 of one engine ends every request with
an error, no hang, no orphan."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from conftest import _MODEL_ROOT, tiny_model, wait_until
from core.engine_spawn import data_parallel_configs
from core.waves import check_waves_config
from frontend import LLM, AsyncLLM, SamplingParams
from frontend.core_client import EngineDeadError, RequestFailedError
from ipc import EngineConfig, RequestOutputKind
from launch.make_model import make_model
from launcher import start_launcher, stop_launcher
from workers.distributed import free_port, parallel_state, set_expert_group, uneven_share
from workers.expert_group import EngineGroup, any_work, exchange_tokens, join_group

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
PROMPTS = [{"prompt_token_ids": [(11 * p + 3 * i) % 400 + 5 for i in range(5 + 7 * p)]} for p in range(6)]


def moe_model(arch: str = "mixtral") -> str:
    """A tiny MoE whose 5 experts split unevenly over 2 engines (3 + 2)."""
    experts = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts"}[arch]
    return str(make_model(_MODEL_ROOT / f"{arch}-tiny-5experts", arch=arch, size="tiny", **{experts: 5}))


def token_ids(llm: LLM, prompts: list[dict], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def test_experts_split_unevenly_and_each_engine_knows_its_place():
    assert [uneven_share(5, rank, 2) for rank in range(2)] == [(0, 3), (3, 5)]
    assert [uneven_share(7, rank, 3) for rank in range(3)] == [(0, 3), (3, 5), (5, 7)]
    configs = data_parallel_configs(EngineConfig(model="unused", data_parallel_size=2, enable_expert_parallel=True),
                                    [0, 1])
    assert [c.data_parallel_rank for c in configs] == [0, 1]
    address = configs[0].data_parallel_ep_address
    assert address.startswith("127.0.0.1:") and configs[1].data_parallel_ep_address == address
    plain = data_parallel_configs(EngineConfig(model="unused", data_parallel_size=2), [0, 1])
    assert [c.data_parallel_ep_address for c in plain] == [None, None]


def in_two_ranks(work) -> list:
    """work(group) run by two ranks of one gloo group (two threads of this process), their results in rank order."""
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    with ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(lambda rank: join_group(address, "test", rank, 2, serve=rank == 0), range(2)))
        return list(pool.map(work, groups))


def test_the_exchange_sums_every_ranks_experts_for_every_ranks_tokens():
    """Rank 0 has 3 tokens, rank 1 none (its dummy pass): rank 0 gets the sum of both ranks' contributions; a rank
    whose step count differs from the other's is out of step."""
    x = torch.randn(3, 4)
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]])
    weights = torch.rand(3, 2)

    def exchange(group):  # rank r's "experts" add (r + 1) * x * the weight of each choice of expert r
        def compute(rows, w, chosen):
            return rows * (w * (chosen == group.rank)).sum(dim=1, keepdim=True) * (group.rank + 1)
        mine = (x, weights, ids) if group.rank == 0 else (x[:0], weights[:0], ids[:0])
        return exchange_tokens(group, *mine, compute)

    out = in_two_ranks(exchange)
    expected = x * ((weights * (ids == 0)).sum(1, keepdim=True) + 2 * (weights * (ids == 1)).sum(1, keepdim=True))
    torch.testing.assert_close(out[0], expected)
    assert out[1].shape == (0, 4)
    assert in_two_ranks(lambda group: any_work(group, group.rank == 1, steps=7)) == [True, True]
    with pytest.raises(RuntimeError, match="out of step"):
        in_two_ranks(lambda group: any_work(group, False, steps=group.rank))


@pytest.mark.parametrize("arch", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_dp_with_expert_parallel_equals_one_engine_and_an_idle_engine_keeps_pace(arch):
    """Six prompts spread over both engines, then three pinned to one engine by their conversation: greedy outputs
    equal one engine's without expert parallel, and each engine holds its share of the experts (3 and 2 of 5).
    While one engine runs the pinned requests the other keeps pace with dummy batches (its forward passes through
    the MoE layers' exchanges alone), and once the wave is over neither steps."""
    pinned = [{**prompt, "cache_salt": "one-conversation"} for prompt in PROMPTS[:3]]
    single = LLM(moe_model(arch), dtype="float32")
    expected, expected_pinned = token_ids(single, PROMPTS), token_ids(single, pinned)
    whole = single.client.info.weight_bytes
    single.shutdown()
    llm = LLM(moe_model(arch), dtype="float32", data_parallel_size=2, enable_expert_parallel=True)

    def dummy_steps() -> list[int]:
        return [engine.num_dummy_steps for engine in llm.get_stats().engines]

    try:
        assert token_ids(llm, PROMPTS) == expected
        assert all(engine.prefix_cache_queries > 0 for engine in llm.get_stats().engines)  # both served
        held = [client.info.weight_bytes for client in llm.client.clients]
        assert whole > held[0] > held[1]
        before = dummy_steps()
        assert token_ids(llm, pinned) == expected_pinned
        after = dummy_steps()
        dummies = [now - then for now, then in zip(after, before)]
        assert min(dummies) == 0 and max(dummies) >= GREEDY.max_tokens, dummies
        time.sleep(0.5)
        assert dummy_steps() == after
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_dp_times_tp_with_expert_parallel_equals_one_engine():
    """DP = 2 x TP = 2: four ranks (two private Rays of two actors) share the 5 experts (2, 1, 1, 1); the engine
    processes exchange the waves' flags, their ranks the tokens."""
    single = LLM(moe_model(), dtype="float32")
    expected = token_ids(single, PROMPTS[:3])
    single.shutdown()
    llm = LLM(moe_model(), dtype="float32", data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
              data_parallel_routing="round_robin", max_model_len=256)
    try:
        assert token_ids(llm, PROMPTS[:3]) == expected
    finally:
        llm.shutdown()


def test_a_rank_of_the_group_holds_its_share_and_runs_one_forward_pass_per_call():
    """A rank's share of the experts (the second of two: 3 and 4 of 0-4), and its runner takes neither the
    multi-step call nor the fused C++ layer: the MoE exchanges are per layer and every engine must run as many
    forward passes as the others."""
    single = LLM(moe_model(), dtype="float32", in_process=True)
    runner = single.client.engine.executor.worker.model_runner
    assert runner.multi_steps > 1 and any(fused_layer(layer) for layer in runner.model.modules())
    single.shutdown()
    state = parallel_state()
    set_expert_group(EngineGroup(rank=1, size=2, group=None, store=None))  # never called: only its place is read
    try:
        split = LLM(moe_model(), dtype="float32", in_process=True)
    finally:
        set_expert_group(state.experts)
    try:
        runner = split.client.engine.executor.worker.model_runner
        assert runner.multi_steps == 1 and runner.moe_layers
        assert all(layer.expert_range == (3, 5) for layer in runner.moe_layers)
        assert not any(fused_layer(layer) for layer in runner.model.modules())
    finally:
        split.shutdown()


def fused_layer(module) -> bool:
    return bool(getattr(module, "takes_one_call", False))


def test_kill_one_engine_fails_every_request_without_hanging():
    """With the experts split, the engine that lives cannot serve alone: it leaves the group at its next exchange,
    and every request of both engines ends with an error within seconds; no process is left behind."""
    async def run() -> None:
        engine = AsyncLLM(moe_model(), dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
                          data_parallel_routing="round_robin")
        pids = [client.process.pid for client in engine.client.clients]
        started = [asyncio.Event() for _ in range(4)]

        async def stream(n: int) -> None:
            async for _ in engine.generate({"prompt_token_ids": [5 + n, 8, 9]}, LONG, f"l{n}"):
                started[n].set()

        try:
            streams = [asyncio.ensure_future(stream(n)) for n in range(4)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            assert set(engine.client.balancer.owner.values()) == {0, 1}
            os.kill(pids[0], signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 10)
            assert time.monotonic() - killed_at < 1.0
            assert engine.client.clients[1].process.wait_exit(5)  # the survivor ends itself: it cannot serve alone
            assert all(isinstance(result, RequestFailedError) for result in results), results
            assert any("expert-parallel group" in str(result) for result in results), results
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate({"prompt_token_ids": [1, 2]}, GREEDY, "after"):
                    pass
        finally:
            engine.shutdown()
        assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), timeout=10)

    asyncio.run(run())


@pytest.mark.parametrize("changes, message", [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size must be 1"),
    ({"data_parallel_backend": "ray"}, "data_parallel_backend 'mp'"),
    ({"data_parallel_ep_address": "nowhere"}, "data_parallel_ep_address must be HOST:PORT"),
    ({"data_parallel_rank": 2}, "data_parallel_rank must be below data_parallel_size"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "takes no speculative_config")])
def test_what_dp_expert_parallel_cannot_run_is_refused(changes, message):
    config = EngineConfig(model="unused", data_parallel_size=2, enable_expert_parallel=True,
                          **{"data_parallel_ep_address": "127.0.0.1:1234", **changes})
    with pytest.raises(ValueError, match=message):
        check_waves_config(config)


@pytest.mark.slow
def test_a_dense_model_is_refused_before_the_engines_meet():
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(tiny_model("llama"), dtype="float32", data_parallel_size=2, enable_expert_parallel=True)


@pytest.mark.slow  # the offline test covers the engines; this, the launcher's flags and the gateway over them
def test_served_through_http_with_two_engines_equal_one_engine():
    single = LLM(moe_model(), dtype="float32")
    expected = [output.outputs[0].text for output in single.generate(PROMPTS[:3], GREEDY, use_tqdm=False)]
    single.shutdown()
    process, base_url = start_launcher([moe_model(), "--dtype", "float32", "--dp", "2", "--enable-expert-parallel",
                                        "--data-parallel-routing", "round_robin", "--max-model-len", "256"])
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS[:3], expected):
            completion = client.completions.create(model=model, prompt=prompt["prompt_token_ids"],
                                                   max_tokens=GREEDY.max_tokens, temperature=0,
                                                   extra_body={"ignore_eos": True})
            assert completion.choices[0].text == text
    finally:
        stop_launcher(process)
