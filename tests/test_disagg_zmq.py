"""ZmqConnector (issue 57, item 3): the prefill engine serves its prompts' KV blocks over ZMQ and the decode engine
pulls them by nonce. A pull is served once, for its own transfer, before its deadline; a producer that is silent,
stopped or killed costs the decode engine at most kv_pull_timeout_s and a recompute, never a wrong token."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import torch
import zmq

from conftest import child_pids, tiny_model, wait_until
from core.kv_cache_manager import KVCacheManager
from core.engine_spawn import data_parallel_configs
from core.kv_transfer import ZmqConnector, make_connector
from core.request import Request
from disagg_cases import GREEDY, PROMPTS, long_prompt, run_alone, stopped, token_prompts
from frontend import LLM, SamplingParams
from ipc import EngineConfig, EngineCoreRequest
from ipc.kv_transfer import KVPulled, KVTransferConfig
from ipc.sockets import free_tcp_address
from launcher import REPO, free_port, start_launcher, stop_launcher
from workers.kv_transfer import TransferRegion
from workers.kv_transfer_endpoint import TransferEndpoint

BLOCK = 4


def _request(request_id: str, ids: list[int], **fields) -> Request:
    core = EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=SamplingParams(), **fields)
    return Request(core, 0, max_tokens=1)


class _Pair:
    """A producer and a consumer connector over loopback in this process, each with its own KV cache and region."""

    def __init__(self, hold_s: float = 60.0, timeout_s: float = 0.5) -> None:
        self.config = KVTransferConfig(kv_connector="ZmqConnector", kv_role="kv_producer", region="group",
                                       kv_port=int(free_tcp_address().rsplit(":", 1)[1]), kv_hold_s=hold_s,
                                       kv_pull_timeout_s=timeout_s)
        self.caches = [torch.randn(8, BLOCK, 3), torch.zeros(8, BLOCK, 3)]
        regions = [TransferRegion(None, [cache], 3 * (BLOCK * 3 * 4 + 32), torch.device("cpu"))
                   for cache in self.caches]
        self.kvs = [KVCacheManager(8, BLOCK), KVCacheManager(8, BLOCK)]
        consumer = msgspec.structs.replace(self.config, kv_role="kv_consumer")
        self.sender = ZmqConnector(self.config, TransferEndpoint(self.config, regions[0]), self.kvs[0])
        self.receiver = ZmqConnector(consumer, TransferEndpoint(consumer, regions[1]), self.kvs[1])

    def send(self, request_id: str, ids: list[int]):
        request = _request(request_id, ids, produce_kv=True)
        self.kvs[0].allocate_slots(request, len(ids))
        params, blocks = self.sender.send(request), self.kvs[0].block_ids(request)
        self.kvs[0].free(request)
        return params, blocks

    def receive(self, request_id: str, ids: list[int], params) -> list[int]:
        """The blocks the consumer's prefix cache holds for the prompt afterwards."""
        request = _request(request_id, ids, kv_transfer_params=params)
        if self.receiver.pull(request):  # as the scheduler does: the pull runs while the loop steps others
            while not self.receiver.arrived():
                self.receiver.wait(0.05)
        self.receiver.receive(request)
        return self.kvs[1].computed_blocks(_request(request_id, ids))

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def pair():
    made = _Pair()
    yield made
    made.close()


def test_each_machine_of_a_split_group_gives_its_engine_the_group_rank_role():
    """--data-parallel-size-local 1 on each machine: engine 0 (the head's) prefills, engine 1 (the headless one's)
    decodes, both named after the kv_port they are given; without ZmqConnector and a kv_port there is no split."""
    connector = {"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_port": 6001}
    config = EngineConfig(model="unused", data_parallel_size=2, kv_transfer_config=connector)
    local = msgspec.structs.replace(config, data_parallel_size=1)
    roles = [(c.kv_transfer_config.kv_role, c.kv_transfer_config.region, c.kv_transfer_config.kv_port)
             for rank in (0, 1) for c in data_parallel_configs(local, [0], first_rank=rank)]
    assert roles == [("kv_producer", "pagedserve-kv-6001", 6001), ("kv_consumer", "pagedserve-kv-6001", 6001)]
    for bad in [{**connector, "kv_port": 0}, {**connector, "kv_connector": "SharedMemoryConnector"}]:
        with pytest.raises(ValueError, match="explicit kv_port"):
            msgspec.structs.replace(EngineConfig(model="unused", data_parallel_size=2, kv_transfer_config=bad),
                                    data_parallel_size=1)
    with pytest.raises(ValueError, match="started alone"):
        make_connector(local.kv_transfer_config, None, None)


def _prompt(k: int) -> list[int]:
    return [n + 10 * k for n in range(9)]


def test_blocks_are_pulled_byte_for_byte_once_and_only_by_their_nonce_from_the_configured_producer(pair):
    params, blocks = pair.send("a", _prompt(0))
    assert params.remote_address == f"tcp://127.0.0.1:{pair.config.kv_port}" and params.num_tokens == 8
    for forged in [msgspec.structs.replace(params, nonce=params.nonce ^ 1),  # the server knows no such transfer
                   msgspec.structs.replace(params, remote_address="tcp://127.0.0.1:1"),  # never connected to
                   msgspec.structs.replace(params, checksum=params.checksum ^ 1)]:
        assert pair.receive("a", _prompt(0), forged) == []
    loaded = pair.receive("a", _prompt(0), params)
    assert len(loaded) == 2 and torch.equal(pair.caches[1][loaded], pair.caches[0][blocks[:2]])
    assert (pair.receiver.blocks_received, pair.receiver.recomputes, pair.sender.blocks_sent) == (2, 3, 2)
    pair.kvs[1].reset_prefix_cache()
    assert pair.receive("a", _prompt(0), params) == [] and pair.receiver.recomputes == 4  # served once
    pair.send("b", _prompt(1))  # the producer takes back the slots the pull ended
    assert sorted(pair.sender.free_slots) == [2]


def test_a_pulled_transfers_slots_go_back_only_after_the_server_copied_them(pair):
    """The engine thread sends another prompt while the server answers a pull (here: just before its copy): the
    new transfer takes a free slot, never one of the transfer being copied."""
    params, blocks = pair.send("a", _prompt(0))
    server = pair.sender.endpoint.server
    copy, sent = server.region.snapshot, []

    def engine_thread_sends_first(slots):
        sent.append(pair.send("b", [n + 100 for n in range(5)])[0])  # one block: a free slot exists
        return copy(slots)

    server.region.snapshot = engine_thread_sends_first
    loaded = pair.receive("a", _prompt(0), params)
    assert len(sent) == 1 and not set(sent[0].slots) & set(params.slots)
    assert len(loaded) == 2 and torch.equal(pair.caches[1][loaded], pair.caches[0][blocks[:2]])
    assert pair.receiver.recomputes == 0


def test_a_malformed_pull_is_answered_with_an_error_and_the_server_serves_on(pair):
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{pair.config.kv_port}")
    try:
        for frames in ([b"\x93garbage"], [b"a", b"b"]):
            client.send_multipart(frames)
            assert client.poll(5000)
            reply = msgspec.msgpack.decode(client.recv(), type=KVPulled)
            assert reply.error and not reply.headers
    finally:
        client.close()
        context.term()
    params, _ = pair.send("a", _prompt(0))
    assert len(pair.receive("a", _prompt(0), params)) == 2


def test_a_malformed_answer_recomputes():
    """A producer answering with frames of the wrong size, header words out of range, or more slots than pulled:
    nothing loaded."""
    pair = _Pair(timeout_s=10.0)
    params, _ = pair.send("a", _prompt(0))
    pair.sender.close()
    context = zmq.Context()
    fake = context.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind(f"tcp://127.0.0.1:{pair.config.kv_port}")
    answers = [[msgspec.msgpack.encode({"pull_id": 1, "headers": [[params.nonce, i, params.checksum] for i in (0, 1)]}),
                b"short"],
               [msgspec.msgpack.encode({"pull_id": 2, "headers": [[-1, 0, 0], [0, 0, 0]]})],
               [msgspec.msgpack.encode({"pull_id": 3, "headers": [[params.nonce, i, params.checksum]
                                                                  for i in range(9)]})]]  # more slots than pulled
    done = threading.Event()

    def answer() -> None:
        for frames in answers:
            while not fake.poll(100):
                if done.is_set():
                    return
            identity, _ = fake.recv_multipart()
            fake.send_multipart([identity, *frames])

    server = threading.Thread(target=answer)
    server.start()
    time.sleep(0.3)  # the consumer's connection comes back (a pull sent before goes to the closed producer)
    try:
        for _ in answers:
            started = time.monotonic()
            assert pair.receive("a", _prompt(0), params) == [] and time.monotonic() - started < 10.0  # answered
        assert pair.receiver.recomputes == 3
    finally:
        done.set()
        server.join()
        fake.close()
        context.term()
        pair.receiver.close()


def test_a_transfer_never_pulled_is_released_after_its_deadline():
    pair = _Pair(hold_s=0.2)
    try:
        params, _ = pair.send("a", _prompt(0))
        time.sleep(0.3)
        pair.send("b", _prompt(1))  # the producer frees a's slots, past their deadline, before taking b's
        assert sorted(pair.sender.free_slots) == [2] and params.nonce not in pair.sender.endpoint.server.offered
        assert pair.receive("a", _prompt(0), params) == [] and pair.receiver.recomputes == 1
    finally:
        pair.close()


def test_a_silent_or_gone_producer_costs_at_most_the_pull_timeout():
    pair = _Pair(timeout_s=0.5)
    params, _ = pair.send("a", _prompt(0))
    pair.sender.close()
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes the producer's place and never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(f"tcp://127.0.0.1:{pair.config.kv_port}")
    try:
        time.sleep(0.3)  # the consumer's connection comes back
        started = time.monotonic()
        assert pair.receive("a", _prompt(0), params) == []
        assert 0.5 <= time.monotonic() - started < 2.0
    finally:
        silent.close()
        context.term()
    started = time.monotonic()
    assert pair.receive("a", _prompt(0), params) == [] and time.monotonic() - started < 2.0  # nobody listens
    assert pair.receiver.recomputes == 2
    pair.receiver.close()


def test_a_stopped_then_killed_prefill_engine_costs_a_recompute_with_the_same_tokens_and_leaves_nothing():
    """The prefill engine frozen (SIGSTOP) while the decode engine pulls, then killed: each pull times out and the
    prompt is computed; new requests go straight to the decode engine; all blocks come back, no process or port is
    left."""
    connector = {"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_buffer_bytes": "128KiB",
                 "kv_pull_timeout_s": 1.0}
    llm = LLM(tiny_model("llama"), dtype="float32", data_parallel_size=2, kv_transfer_config=connector)
    try:
        prefill, decode = llm.client.clients
        one = SamplingParams(temperature=0.0, max_tokens=1)
        prompts = [long_prompt(n) for n in range(3)]
        expected = [run_alone(decode, EngineCoreRequest(request_id=f"plain{n}", prompt_token_ids=ids,
                                                        sampling_params=GREEDY))[0] for n, ids in enumerate(prompts)]
        sent = [run_alone(prefill, EngineCoreRequest(request_id=f"p{n}", prompt_token_ids=ids, sampling_params=one,
                                                     produce_kv=True))[1].kv_transfer_params
                for n, ids in enumerate(prompts[:2])]
        port = int(sent[0].remote_address.rsplit(":", 1)[1])
        for client in llm.client.clients:  # the engines share no memory: the KV goes over TCP alone
            assert "/dev/shm/pagedserve-kv" not in Path(f"/proc/{client.process.pid}/maps").read_text()
        os.kill(prefill.process.pid, signal.SIGSTOP)
        assert wait_until(lambda: stopped(prefill.process.pid), timeout=10)
        for n in [0, "killed"]:
            if n == "killed":
                os.kill(prefill.process.pid, signal.SIGKILL)
                assert prefill.process.wait_exit(5)
                n = 1
            decode.call_utility("reset_prefix_cache")
            started = time.monotonic()
            got, _ = run_alone(decode, EngineCoreRequest(request_id=f"d{n}", prompt_token_ids=prompts[n],
                                                         sampling_params=GREEDY, kv_transfer_params=sent[n]))
            took = time.monotonic() - started
            assert got == expected[n] and took < 3.0 and (n == 1 or took >= 1.0)  # killed: maybe refused at once
        stats = decode.get_stats()
        assert stats.kv_transfer_recomputes == 2 and stats.kv_transfer_blocks_received == 0
        outputs = llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY, use_tqdm=False)
        assert outputs[0].outputs[0].token_ids == expected[2]
        stats = decode.get_stats()  # the group's own counts the dead engine's blocks as gone
        assert stats.num_free_blocks == decode.info.num_kv_blocks and stats.num_running == stats.num_waiting == 0
    finally:
        llm.shutdown()
    assert not child_pids()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # nothing serves KV any more


@pytest.mark.slow  # two launchers; the loopback group above runs the same transfer by default
def test_a_group_split_over_two_machines_hands_the_kv_over_tcp():
    """Two launchers on loopback standing in for two machines: the head's engine prefills, the headless one's
    decodes, their KV over ZMQ at the kv_port both are given; the completions are one engine's, and the decode engine
    found the prompts' blocks (loaded) in its prefix cache."""
    single = LLM(tiny_model("llama"), dtype="float32")
    try:
        expected = [output.outputs[0].text for output in single.generate(token_prompts(PROMPTS), GREEDY,
                                                                          use_tqdm=False)]
    finally:
        single.shutdown()
    connector = {"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_buffer_bytes": "128KiB",
                 "kv_ip": "127.0.0.1", "kv_port": free_port()}
    common = [tiny_model("llama"), "--dtype", "float32", "--max-model-len", "256", "--dp", "2",
              "--data-parallel-size-local", "1", "--engine-insecure-loopback",
              "--kv-transfer-config", msgspec.json.encode(connector).decode()]
    port = free_port()
    node = subprocess.Popen([sys.executable, "-m", "launch", *common, "--headless", "--data-parallel-address",
                             "127.0.0.1", "--data-parallel-rpc-port", str(port)], cwd=REPO)
    head = None
    try:
        head, base_url = start_launcher([*common, "--data-parallel-remote", f"tcp://127.0.0.1:{port}"])
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        served = [client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text for ids in PROMPTS]
        assert served == expected
        hits = re.search(r'prefix_cache_hits_total\{[^}]*engine="1"[^}]*\} ([0-9.e+]+)',
                         httpx.get(f"{base_url}/metrics").text)
        size = 16
        assert hits is not None and float(hits.group(1)) == size * sum((len(ids) - 1) // size for ids in PROMPTS)
    finally:
        if head is not None:
            stop_launcher(head)
        stop_launcher(node)
