"""Disaggregated prefill where each rank copies its own KV shard (issue 57, item 3): ZmqConnector between engines whose
ranks are Ray actors (data_parallel_backend "ray"; tensor parallel 2 on the mp backend, an engine on each of two Ray
nodes): the producer's server and the consumer's pulls live in the ranks; greedy outputs equal one engine's, the
blocks go over, a failed transfer recomputes the same tokens."""
from __future__ import annotations

import os
import re

import msgspec
import psutil
import pytest
import torch

# As tests/test_distributed.py: Ray keeps a 127.0.0.1 cluster on loopback only when told the machine's IP is loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray  # noqa: E402  (a base dependency: missing, the tests must fail, not skip)
from ray.cluster_utils import Cluster  # noqa: E402

from conftest import assert_all_blocks_free, tiny_model  # noqa: E402
from disagg_cases import GREEDY, PROMPTS, decode_from_each, run_alone, token_prompts  # noqa: E402
from frontend import LLM, SamplingParams  # noqa: E402
from ipc import EngineConfig, EngineCoreRequest  # noqa: E402
from ipc.kv_transfer import KVTransferConfig  # noqa: E402
from workers.kv_transfer import TransferRegion  # noqa: E402
from workers.kv_transfer_endpoint import RemoteEndpoint, TransferEndpoint  # noqa: E402

# Ray runs the ranks (the producer's server among them) at nice 15: on a busy machine a pull waits longer than 5 s.
CONNECTOR = {"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_buffer_bytes": "128KiB",
             "kv_pull_timeout_s": 30.0}
# (data_parallel_backend, tensor_parallel_size, pipeline_parallel_size): a Ray actor per engine, then two ranks per
# engine on the mp backend (four rank actors: slow on two cores), as TP ranks filling a node each, or pipeline stages.
GROUPS = [("ray", 1, 1), *(pytest.param(("mp", *sizes), marks=pytest.mark.slow) for sizes in [(2, 1), (1, 2)])]


@pytest.fixture(scope="module")
def ray_address():
    """Two Ray "nodes" of 2 CPUs each on loopback, which the engines join; this process is a driver of it."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address)
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    single = LLM(tiny_model("llama"), dtype="float32")
    try:
        return [o.outputs[0].token_ids for o in single.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)]
    finally:
        single.shutdown()


@pytest.fixture(scope="module", params=GROUPS, ids=["ray-tp1", "mp-tp2", "mp-pp2"])
def group(request, ray_address):
    backend, tp, pp = request.param
    llm = LLM(tiny_model("llama"), dtype="float32", data_parallel_size=2, data_parallel_backend=backend,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, ray_address=ray_address, kv_transfer_config=CONNECTOR)
    yield llm, tp, pp
    llm.shutdown()


def test_greedy_outputs_equal_one_engines_and_each_rank_sends_its_shard(group, expected):
    group, tp, pp = group
    nodes = [set(g["bundles_to_node_id"].values()) for g in ray.util.placement_group_table().values()
             if g["state"] == "CREATED"]  # a placement group per engine and stage
    assert len(nodes) == 2 * pp and (tp == 1 or nodes[0] != nodes[1]), nodes  # tp 2: the engines on a node each
    before = group.get_stats()
    outputs = group.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    stats, size = group.get_stats(), group.info.block_size
    blocks = sum((len(ids) - 1) // size for ids in PROMPTS)
    assert stats.kv_transfer_blocks_sent - before.kv_transfer_blocks_sent == blocks, (before, stats)
    assert stats.engines[1].kv_transfer_blocks_received - before.kv_transfer_blocks_received == blocks, (before, stats)
    assert stats.kv_transfer_recomputes == before.kv_transfer_recomputes, (before, stats)
    assert_all_blocks_free(group)


def test_a_forged_or_repeated_pull_recomputes_the_same_tokens(group, expected):
    """Every producer rank serves its own shard from its Ray actor (kv_port + rank). A forged nonce is refused by
    every producer rank; a transfer pulled once is not served again: both times the
    decode engine computes the prompt itself."""
    group, tp, pp = group
    prefill, decode = group.client.clients
    ids = PROMPTS[-1]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    sent = run_alone(prefill, EngineCoreRequest(request_id="p", prompt_token_ids=ids, sampling_params=one,
                                                produce_kv=True))[1].kv_transfer_params
    port = int(sent.remote_address.rsplit(":", 1)[1])
    servers = {c.laddr.port: psutil.Process(c.pid) for c in psutil.net_connections("tcp")
               if c.status == psutil.CONN_LISTEN and c.pid is not None and port <= c.laddr.port < port + 2}
    assert sorted(servers) == list(range(port, port + tp * pp))  # each producer rank serves its shard, from its actor
    assert all(server.cmdline()[0].startswith("ray::RankWorker") for server in servers.values())
    forged = msgspec.structs.replace(sent, nonce=sent.nonce ^ 1)
    before = decode.get_stats()
    assert decode_from_each(decode, ids, [("forged", forged), ("intact", sent), ("again", sent)]) == [expected[-1]] * 3
    stats = decode.get_stats()
    assert stats.kv_transfer_recomputes - before.kv_transfer_recomputes == 2
    assert stats.kv_transfer_blocks_received - before.kv_transfer_blocks_received == len(sent.slots)


def test_shared_memory_still_needs_single_rank_mp_engines():
    for fields in [{"data_parallel_backend": "ray"}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]:
        with pytest.raises(ValueError, match="SharedMemoryConnector"):
            EngineConfig(model="unused", data_parallel_size=2, kv_transfer_config={
                **CONNECTOR, "kv_connector": "SharedMemoryConnector"}, **fields)


def test_a_step_calls_only_the_endpoints_own_methods():
    """A rank's endpoint answers the methods the connector uses, by name, and refuses any other attribute."""
    cache = torch.zeros(4, 4, 3)
    region = TransferRegion(None, [cache], 2 * (cache[0].numel() * 4 + 32), torch.device("cpu"))
    endpoint = TransferEndpoint(KVTransferConfig(kv_connector="SharedMemoryConnector", kv_role="kv_producer",
                                                 region="group"), region)
    assert endpoint.call("num_slots", []) == 2 and endpoint.call("released", [[0, 1]]) == [0, 1]
    for name in ["close", "region", "__init__"]:
        with pytest.raises(ValueError, match=f"unknown method '{re.escape(name)}'"):
            endpoint.call(name, [])
    with pytest.raises(AttributeError):
        RemoteEndpoint(None).region  # noqa: B018  (the engine core's handle forwards the same names alone)
