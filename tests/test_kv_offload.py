"""The prefix cache's host tier (core/kv_offload.py, workers/kv_offload.py): LRU slots by hash, the step's copies,
multi-step calls storing what their later steps overwrite, and outputs equal to an engine without the tier."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_blocks_free, random_prompts, tiny_model
from core.kv_cache_manager import KVCacheManager
from core.kv_offload import OffloadTier
from core.scheduler import Scheduler
from frontend import LLM, SamplingParams
from ipc import EngineConfig, ModelRunnerOutput
from scheduler_steps import make_request, run_step
from workers.kv_offload import HostKVTier


def test_tier_keeps_the_most_recent_hashes_and_reuses_the_oldest_slot():
    tier = OffloadTier(2)
    tier.store(10, b"a")
    tier.store(11, b"b")
    tier.store(12, b"a")  # held already: no second copy, but now the most recent
    assert tier.take_copies() == ([(10, 0), (11, 1)], [])
    tier.store(13, b"c")  # evicts b, the least recently stored or hit
    assert b"b" not in tier and b"a" in tier and b"c" in tier
    assert tier.take_copies() == ([(13, 1)], [])
    assert tier.claim([b"a"]) == [0]  # a hit: most recent, and its slot is read this step
    tier.load([0], [5])
    tier.store(14, b"d")  # c is the oldest now; a's slot is pinned anyway
    assert tier.take_copies() == ([(14, 1)], [(0, 5)])
    assert b"c" not in tier and tier.blocks_loaded == 1


def test_a_pinned_slot_is_never_stored_into_and_a_slot_stored_twice_copies_once():
    tier = OffloadTier(1)
    tier.store(1, b"a")
    tier.take_copies()
    tier.claim([b"a"])
    tier.store(2, b"b")  # the only slot is read by this step's load: nothing stored
    assert b"b" not in tier and tier.take_copies() == ([], [])
    tier.store(3, b"c")
    tier.store(4, b"d")  # the same step reuses c's slot: only the last copy into it runs
    assert tier.take_copies() == ([(4, 0)], []) and b"d" in tier and b"c" not in tier


def test_a_refused_allocation_takes_no_block_and_no_host_slot():
    kv = KVCacheManager(num_blocks=3, block_size=4, num_host_blocks=4)
    first = make_request(0, prompt_len=9)
    assert kv.allocate_slots(first, 8) is not None
    kv.free(first)
    other = make_request(1, prompt_len=12)
    other.cache_salt = "other"  # other content
    assert kv.allocate_slots(other, 12) is not None  # evicts both of first's blocks into the tier
    assert sorted(kv.take_copies()[0]) == [(0, 1), (1, 0)]
    again = make_request(2, prompt_len=9)
    computed = kv.computed_blocks(again)
    assert computed == first.block_hashes[:2]  # both found in the tier
    assert kv.allocate_slots(again, 1, computed) is None  # no free block to load them into
    assert kv.take_copies() == ([], []) and not kv.tier.pinned and kv.num_free_blocks == 0
    kv.free(other)
    assert kv.allocate_slots(again, 1, computed) is not None
    stores, loads = kv.take_copies()
    assert loads == [(1, kv.block_ids(again)[0]), (0, kv.block_ids(again)[1])]
    assert {slot for _, slot in stores}.isdisjoint({0, 1})  # the slots loaded from are not stored into
    assert kv.prefix_cache_host_hits == 8
    kv.free(again)
    assert kv.num_free_blocks == 3


def test_a_multi_step_call_stores_the_block_its_later_steps_overwrite():
    """The blocks a multi-step call's later steps write are allocated when the call is scheduled: a hashed block
    evicted for them is stored by that call's copies, which the worker runs before the call's first step. Then a
    tier hit, aborted after its step was sent: its loaded block stays findable in the device cache."""
    config = EngineConfig(model="unused", block_size=4, max_model_len=64, multi_step_budget_ms=None)
    scheduler = Scheduler(config, KVCacheManager(3, 4, num_host_blocks=4), multi_step=4)
    scheduler.add_request(make_request(0, prompt_len=8, max_tokens=1))
    run_step(scheduler)  # finishes: its two hashed blocks are free and cached
    decoder = make_request(1, prompt_len=3, max_tokens=5)
    decoder.cache_salt = "other"
    scheduler.add_request(decoder)
    run_step(scheduler)  # the prefill, in the one block never used
    call = scheduler.schedule()
    [cached] = call.scheduled_cached_reqs
    assert call.num_steps == 4 and len(cached.new_block_ids) == 1
    assert call.kv_stores == [(cached.new_block_ids[0], 0)] and call.kv_loads == []
    scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids={"r1": [7, 7, 7, 7]}))
    assert not scheduler.has_unfinished_requests()
    # The first request's prompt again: its first block from the device, its second loaded from the tier.
    scheduler.add_request(make_request(2, prompt_len=9))
    out = scheduler.schedule()
    [new] = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.kv_loads == [(0, new.block_ids[1])]
    scheduler.abort_requests(["r2"])  # its step (with the load) went to the workers: the loaded block stays cached
    scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids={"r2": [7]}))
    scheduler.add_request(make_request(3, prompt_len=9))
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].block_ids[:2] == new.block_ids[:2] and out.kv_loads == []
    scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids={"r3": [7]}))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.kv.num_free_blocks == 3 and scheduler.kv.take_copies() == ([], [])


def test_host_copies_keep_the_bytes_of_any_cache_dtype():
    caches = [torch.randn(4, 2, 3, 5).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)]
    before = [cache.clone() for cache in caches]
    tier = HostKVTier(caches, 3, torch.device("cpu"))
    tier.apply([(1, 2), (3, 0)], [])
    tier.apply([(0, 1)], [(2, 0), (0, 3)])  # block 0 is stored before it is overwritten by a load
    tier.apply([], [(1, 2)])
    for cache, old in zip(caches, before):
        expected = [old[1], old[1], old[0], old[3]]  # block 2 got block 0 back, as stored before its load
        assert all(torch.equal(cache[i].view(torch.uint8), e.view(torch.uint8)) for i, e in enumerate(expected))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copies_run_after_the_queued_writes_and_before_the_next_step():
    cache = torch.zeros(64, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
    tier = HostKVTier([cache], 8, torch.device("cuda"))
    assert tier.host[0].is_pinned()
    torch.cuda._sleep(10_000_000)  # the write below is still queued when the copies are issued
    cache[3:5].fill_(2.0)
    tier.apply([(3, 6), (4, 7), (9, 0)], [])
    tier.apply([], [(6, 10), (7, 11)])
    total = cache[10:12].float().sum().item()  # on the current stream: after the loads
    assert total == 2.0 * 2 * 4 * 16 * 64 and torch.equal(tier.host[0][0], torch.zeros_like(tier.host[0][0]))


@pytest.fixture(scope="module")
def prefix_workload() -> tuple[list[dict], SamplingParams]:
    """12 prefixes of 3 blocks (3x a 12-block cache), each asked twice, the second round after all the others; each
    prompt ends 3 tokens short of a block, so its decodes take a block (evicting one) in a multi-step call."""
    bases = random_prompts([48] * 12, 256, seed=11)
    tails = random_prompts([13] * 24, 256, seed=12)
    prompts = [{"prompt_token_ids": bases[i % 12] + tails[i]} for i in range(24)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(prefix_workload) -> list[list[int]]:
    """The workload's outputs with no prefix caching at all."""
    plain = LLM(tiny_model("llama"), dtype="float32", in_process=True, enable_prefix_caching=False)
    outputs = plain.generate(*prefix_workload, use_tqdm=False)
    plain.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


def test_outputs_with_the_tier_equal_outputs_without_and_it_finds_more(prefix_workload, expected):
    prompts, params = prefix_workload
    engine = dict(dtype="float32", in_process=True, num_kv_blocks=12, max_model_len=128, max_num_seqs=2,
                  num_scheduler_steps=4, multi_step_budget_ms=None)
    hits = {}
    for host in (None, "16MiB"):
        llm = LLM(tiny_model("llama"), kv_offload_bytes=host, **engine)
        core = llm.client.engine
        calls = []
        submit = core.executor.submit_batch
        core.executor.submit_batch = lambda so, grammars=None: calls.append(so) or submit(so, grammars)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert_all_blocks_free(llm)
        kv = core.kv_cache_manager
        hits[host] = kv.prefix_cache_hits
        if host is None:
            assert kv.tier is None and kv.prefix_cache_host_hits == 0
        else:
            assert kv.prefix_cache_host_hits >= 12 * 48 // 2 and kv.tier.take_copies() == ([], [])
            assert any(so.num_steps > 1 and so.kv_stores for so in calls)  # multi-step calls that evicted
            assert sum(len(so.kv_loads) for so in calls) == kv.tier.blocks_loaded
            assert llm.get_stats().prefix_cache_host_hits == kv.prefix_cache_host_hits  # the stats and /metrics'
        llm.shutdown()
    assert hits["16MiB"] > hits[None] + 12 * 48 // 2


def test_an_fp8_cache_goes_to_the_tier_as_stored(prefix_workload):
    """One byte an element in the tier as in the cache: a 16 MiB tier holds 4x the fp8 blocks of float32 ones, and
    outputs equal those of the same fp8 engine without prefix caching."""
    prompts, params = prefix_workload
    engine = dict(dtype="float32", in_process=True, max_model_len=128, kv_cache_dtype="fp8")
    plain = LLM(tiny_model("llama"), enable_prefix_caching=False, **engine)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(tiny_model("llama"), num_kv_blocks=12, max_num_seqs=2, kv_offload_bytes="16MiB", **engine)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    worker, kv = llm.client.engine.executor.worker, llm.client.engine.kv_cache_manager
    assert kv.prefix_cache_host_hits > 0 and kv.tier.num_slots == 16 * 2**20 // worker.block_bytes()
    assert worker.block_bytes() * 4 == sum(layer.kv_block_bytes(16, torch.float32)
                                           for layer in worker.model_runner.attention_layers)
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_preempted_requests_resume_through_the_tier(prefix_workload, expected):
    """8 blocks for up to 4 requests of 5 blocks each: decodes preempt the latest requests, which resume from
    their own blocks, in the device cache or loaded back from the tier."""
    prompts, params = prefix_workload
    llm = LLM(tiny_model("llama"), dtype="float32", in_process=True, num_kv_blocks=8, max_model_len=128,
              max_num_seqs=4, kv_offload_bytes="16MiB")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.get_stats().num_preemptions > 0 and llm.client.engine.kv_cache_manager.prefix_cache_host_hits > 0
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_every_rank_copies_its_own_shard(prefix_workload, expected, tp, pp):
    """On Ray ranks (a private local Ray): each rank applies the same copies to the layers and heads it holds."""
    llm = LLM(tiny_model("llama"), dtype="float32", in_process=True, num_kv_blocks=12, max_model_len=128,
              max_num_seqs=2, tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_offload_bytes="16MiB")
    assert [o.outputs[0].token_ids for o in llm.generate(*prefix_workload, use_tqdm=False)] == expected
    assert llm.client.engine.kv_cache_manager.prefix_cache_host_hits > 0
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_offload_needs_prefix_caching_and_room_for_a_block():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(tiny_model("llama"), in_process=True, kv_offload_bytes=2**20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        LLM(tiny_model("llama"), in_process=True, kv_offload_bytes=16)
