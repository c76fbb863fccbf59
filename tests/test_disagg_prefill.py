"""Disaggregated prefill (issue 57, item 3): a data-parallel group of two engines with kv_transfer_config "kv_both",
engine 0 prefilling and handing the prompt's KV blocks over shared memory to engine 1, which decodes. Greedy outputs
equal one engine's (offline, over HTTP); a slot overwritten or not matching recomputes; a killed engine ends its
requests cleanly."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import msgspec
import openai
import pytest
import torch

from conftest import assert_all_blocks_free, child_pids, long_context_llama, tiny_model, wait_until
from disagg_cases import GREEDY, PROMPTS, decode_from_each, long_prompt, run_alone, token_prompts
from core.engine_spawn import data_parallel_configs
from core.kv_cache_manager import KVCacheManager
from core.kv_transfer import KVConnector, token_checksum
from core.request import Request
from frontend import LLM, AsyncLLM, SamplingParams
from frontend.core_client import EngineDeadError, RequestFailedError
from frontend.disagg_proxy import DisaggProxy
from frontend.dp_balance import EngineBalancer
from ipc import EngineConfig, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, RequestOutputKind
from ipc.kv_transfer import KVTransferConfig, KVTransferParams
from launcher import descendants, start_launcher, stop_launcher
from workers.kv_transfer import TransferRegion
from workers.kv_transfer_endpoint import TransferEndpoint

CONNECTOR = {"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both", "kv_buffer_bytes": "128KiB"}
CONNECTORS = [CONNECTOR, {**CONNECTOR, "kv_connector": "ZmqConnector"}]


@pytest.fixture(scope="module")
def reference() -> list:
    """One engine's greedy completion of each prompt."""
    single = LLM(tiny_model("llama"), dtype="float32")
    try:
        return [o.outputs[0] for o in single.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)]
    finally:
        single.shutdown()


@pytest.fixture(scope="module")
def expected(reference) -> list[list[int]]:
    return [completion.token_ids for completion in reference]


@pytest.fixture(scope="module", params=CONNECTORS, ids=lambda connector: connector["kv_connector"])
def group(request):
    llm = LLM(tiny_model("llama"), dtype="float32", data_parallel_size=2, kv_transfer_config=request.param)
    yield llm
    llm.shutdown()


def test_the_config_is_checked_by_name():
    for bad, field in [({**CONNECTOR, "kv_connector": "NixlConnector"}, "kv_connector"),
                       ({**CONNECTOR, "kv_role": "prefill"}, "kv_role"), ({**CONNECTOR, "kv_rank": 1}, "kv_rank"),
                       ({**CONNECTOR, "kv_ip": "a b"}, "kv_ip"), ({**CONNECTOR, "kv_port": 70000}, "kv_port"),
                       ({**CONNECTOR, "region": "../etc"}, "region"),
                       ({**CONNECTOR, "kv_buffer_bytes": "lots"}, "kv_buffer_bytes")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="unused", data_parallel_size=2, kv_transfer_config=bad)
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        EngineConfig(model="unused", kv_transfer_config=CONNECTOR)
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        EngineConfig(model="unused", data_parallel_size=2, kv_transfer_config=CONNECTOR, kv_offload_bytes=1 << 20)
    as_json = msgspec.json.encode(CONNECTOR).decode()  # as the CLI flag gives it
    config = EngineConfig(model="unused", data_parallel_size=2, kv_transfer_config=as_json)
    producer, consumer = (c.kv_transfer_config for c in data_parallel_configs(config, [0, 1]))
    assert (producer.kv_role, consumer.kv_role) == ("kv_producer", "kv_consumer")
    assert producer.region == consumer.region and producer.kv_buffer_bytes == 128 << 10


class _Engine:
    """An engine client that records what it is sent."""

    def __init__(self) -> None:
        self.sent: list[EngineCoreRequest] = []
        self.dead_reason = None

    def add_request(self, request: EngineCoreRequest) -> None:
        self.sent.append(request)


def test_the_proxy_sends_prefill_then_decode_and_ends_aborted_or_orphaned_prefills_once():
    group = SimpleNamespace(clients=[_Engine(), _Engine()], balancer=EngineBalancer(2, 16), dead_reason=None,
                            info=SimpleNamespace(block_size=16))
    proxy = DisaggProxy(group)
    params = SamplingParams(temperature=0.0, max_tokens=50, min_tokens=5, stop=["x"], logprobs=2)
    for rid, ids in [("short", list(range(1, 17))), ("a", list(range(1, 18))), ("b", list(range(1, 40))),
                     ("c", list(range(1, 40)))]:
        proxy.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=ids, sampling_params=params))
    prefill, decode = group.clients
    assert [r.request_id for r in decode.sent] == ["short"] and [r.request_id for r in prefill.sent] == ["a", "b", "c"]
    sent = prefill.sent[0]
    assert sent.produce_kv and sent.sampling_params.max_tokens == 1 and sent.sampling_params.min_tokens == 0
    assert sent.sampling_params.stop is None and sent.sampling_params.logprobs is None
    transfer = KVTransferParams(region="r", slots=[3], num_tokens=16, nonce=7, checksum=9)
    proxy.abort(["b"])
    done = [EngineCoreOutput(request_id=rid, new_token_ids=[5], finish_reason=FinishReason.LENGTH,
                             kv_transfer_params=transfer) for rid in ("a", "b")]
    batch = proxy.filter(EngineCoreOutputs(outputs=[*done, EngineCoreOutput(request_id="short", new_token_ids=[1])]))
    assert [(o.request_id, o.finish_reason) for o in batch.outputs] == [("b", FinishReason.ABORT), ("short", None)]
    assert decode.sent[-1].request_id == "a" and decode.sent[-1].kv_transfer_params == transfer
    assert decode.sent[-1].sampling_params == params and not decode.sent[-1].produce_kv
    group.balancer.engine_died(0)
    orphaned = proxy.prefill_engine_died()  # c goes on without KV
    assert not orphaned.outputs and not orphaned.errors and decode.sent[-1].request_id == "c"
    assert decode.sent[-1].kv_transfer_params is None and group.balancer.owner == {"short": 1, "a": 1, "c": 1}


def _request(request_id: str, ids: list[int], **fields) -> Request:
    core = EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=SamplingParams(), **fields)
    return Request(core, 0, max_tokens=1)


def test_slots_are_checked_reused_least_recently_written_first_and_a_mismatch_loads_nothing(tmp_path):
    """Two engines' worth of KV caches over one region, in this process: blocks go over byte for byte; a slot
    rewritten since, or tokens not the ones sent, leave the decode side's cache without them."""
    name = f"pagedserve-kv-test-{os.getpid()}"
    block = 4
    producer_cache, consumer_cache = torch.randn(8, block, 3), torch.zeros(8, block, 3)
    try:
        regions = [TransferRegion(name, [cache], 3 * (block * 3 * 4 + 32), torch.device("cpu"))
                   for cache in (producer_cache, consumer_cache)]
    finally:
        os.unlink(f"/dev/shm/{name}")
    producer_kv, consumer_kv = KVCacheManager(8, block), KVCacheManager(8, block)
    sender, receiver = (KVConnector(role, name, TransferEndpoint(KVTransferConfig(
        kv_connector="SharedMemoryConnector", kv_role=role, region=name), region), kv)
        for role, region, kv in [("kv_producer", regions[0], producer_kv), ("kv_consumer", regions[1], consumer_kv)])
    prompts = {rid: [n + 10 * k for n in range(9)] for k, rid in enumerate("abc")}
    sent, blocks = {}, {}
    for rid, ids in prompts.items():
        request = _request(rid, ids, produce_kv=True)
        producer_kv.allocate_slots(request, len(ids))
        sent[rid], blocks[rid] = sender.send(request), producer_kv.block_ids(request)[:2]
        producer_kv.free(request)
    # Three slots: b takes the free one and a's first, c what b did not rewrite of a's and b's oldest.
    assert [sent[rid].slots for rid in "abc"] == [[0, 1], [0, 2], [0, 1]] and sent["a"].num_tokens == 8
    assert sent["a"].checksum == token_checksum(prompts["a"][:8])
    forged = msgspec.structs.replace(sent["c"], checksum=sent["c"].checksum ^ 1)
    for rid, params in [("a", sent["a"]), ("c", forged)]:  # overwritten, then not these tokens
        receiver.receive(_request(rid, prompts[rid], kv_transfer_params=params))
        assert consumer_kv.computed_blocks(_request(rid, prompts[rid])) == []
    request = _request("c", prompts["c"], kv_transfer_params=sent["c"])
    receiver.receive(request)
    loaded = consumer_kv.computed_blocks(request)
    assert len(loaded) == 2 and consumer_kv.num_free_blocks == 8  # in the prefix cache, held by nobody
    assert torch.equal(consumer_cache[loaded], producer_cache[blocks["c"]])
    assert (receiver.blocks_received, receiver.recomputes, sender.blocks_sent) == (2, 2, 6)
    assert all(regions[0].released(slot) for slot in sent["c"].slots)  # the decode side released them
    again = _request("c", prompts["c"], produce_kv=True)
    producer_kv.allocate_slots(again, 9)
    resent = sender.send(again)
    receiver.receive(_request("c", prompts["c"], kv_transfer_params=resent))  # its prefix cache holds them
    assert all(regions[0].released(slot) for slot in resent.slots) and receiver.blocks_received == 2


def test_greedy_outputs_equal_one_engines_and_the_blocks_go_over(group, expected):
    before = group.get_stats()
    outputs = group.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    stats, size = group.get_stats(), group.info.block_size
    blocks = sum((len(ids) - 1) // size for ids in PROMPTS)  # the 5- and 16-token prompts went straight to decode
    assert stats.kv_transfer_blocks_sent - before.kv_transfer_blocks_sent == blocks
    assert stats.engines[1].kv_transfer_blocks_received - before.kv_transfer_blocks_received == blocks
    assert stats.kv_transfer_recomputes == before.kv_transfer_recomputes
    assert_all_blocks_free(group)


def test_an_overwritten_or_forged_transfer_recomputes_the_same_tokens(group, expected):
    prefill, decode = group.client.clients
    one = SamplingParams(temperature=0.0, max_tokens=1)
    ids = PROMPTS[-1]

    def prefilled(request_id: str, prompt: list[int]) -> KVTransferParams:
        return run_alone(prefill, EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=one,
                                               produce_kv=True))[1].kv_transfer_params

    overwritten, n = prefilled("first", ids), 0
    while not set(prefilled(f"later{n}", long_prompt(n)).slots) & set(overwritten.slots):  # a later one reuses a slot
        n += 1
        assert n < 20
    fresh = prefilled("again", ids)
    forged = msgspec.structs.replace(fresh, nonce=fresh.nonce ^ 1)
    before = decode.get_stats()
    transfers = [("overwritten", overwritten), ("forged", forged), ("intact", fresh)]
    assert decode_from_each(decode, ids, transfers) == [expected[len(PROMPTS) - 1]] * 3
    stats = decode.get_stats()
    assert stats.kv_transfer_recomputes - before.kv_transfer_recomputes == 2
    assert stats.kv_transfer_blocks_received - before.kv_transfer_blocks_received == len(fresh.slots) == 4


@pytest.mark.parametrize("connector", CONNECTORS, ids=lambda connector: connector["kv_connector"])
def test_served_over_http_equal_one_engine(reference, connector):
    connector = msgspec.json.encode(connector).decode()
    process, base_url = start_launcher([tiny_model("llama"), "--dtype", "float32", "--dp", "2",
                                        "--max-model-len", "256", "--kv-transfer-config", connector])
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for ids, completion in zip(PROMPTS, reference):
            served = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
            assert served.choices[0].text == completion.text
        engines = [pid for pid, command in descendants(process.pid) if "core.engine_process" in command]
        assert len(engines) == 2
    finally:
        stop_launcher(process)
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in engines), timeout=10)


@pytest.mark.parametrize("connector", CONNECTORS, ids=lambda connector: connector["kv_connector"])
def test_a_killed_prefill_engine_hands_over_to_decode_and_a_killed_decode_engine_fails_at_once(connector):
    """Prefill engine killed: streams on the decode engine go on, its requests (and new ones) compute their prompts
    there. Decode engine killed: every request ends with an error within a second. (The 64k-context llama: its
    streams run for many seconds on any machine.)"""
    async def final(engine: AsyncLLM, request_id: str, ids: list[int], params: SamplingParams,
                    started: asyncio.Event | None = None) -> list[int]:
        tokens = []
        async for output in engine.generate({"prompt_token_ids": ids}, params, request_id):
            tokens += output.outputs[0].token_ids
            if started is not None:
                started.set()
        return tokens

    async def run() -> None:
        engine = AsyncLLM(long_context_llama(), dtype="float32", data_parallel_size=2, kv_transfer_config=connector)
        pids = [client.process.pid for client in engine.client.clients]
        try:
            long = SamplingParams(temperature=0.0, max_tokens=30_000, ignore_eos=True,
                                  output_kind=RequestOutputKind.DELTA)
            delta = msgspec.structs.replace(GREEDY, output_kind=RequestOutputKind.DELTA)
            started = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.ensure_future(final(engine, f"s{i}", long_prompt(i), long, started[i]))
                       for i in range(4)]
            await asyncio.gather(*(event.wait() for event in started))
            os.kill(pids[0], signal.SIGKILL)
            after = await asyncio.gather(*(final(engine, f"a{i}", ids, delta) for i, ids in enumerate(PROMPTS)))
            assert all(len(tokens) == 12 for tokens in after) and not any(stream.done() for stream in streams)
            await engine.check_serving()  # without its prefill engine the group still serves
            os.kill(pids[1], signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.gather(*streams, return_exceptions=True)
            assert all(isinstance(result, RequestFailedError) for result in results), results
            assert time.monotonic() - killed_at < 1.0
            with pytest.raises(EngineDeadError, match="engine core 1"):
                await engine.check_serving()
        finally:
            engine.shutdown()
        assert not set(pids) & set(child_pids())

    asyncio.run(run())
