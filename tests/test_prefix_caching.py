"""Automatic prefix caching: block hashes, sharing, LRU eviction, salts, and outputs equal to caching off."""
from __future__ import annotations

import pytest

from core.block_hash import extend_block_hashes, hash_block
from core.block_pool import BlockPool
from frontend import LLM, SamplingParams
from ipc import ModelRunnerOutput
from conftest import assert_all_blocks_free, random_prompts, tiny_model
from scheduler_steps import make_request, make_scheduler


def test_block_hashes_chain_on_the_parent_and_the_salt():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(hashes) == 2  # the partial third block has no hash yet
    assert hashes[1] == hash_block(hashes[0], [5, 6, 7, 8])
    assert hash_block(None, [5, 6, 7, 8]) != hashes[1]  # same tokens, other parent: other block
    assert hash_block(None, [1, 2, 3, 4], cache_salt="a") != hashes[0] != hash_block(None, [1, 2, 3, 4], "b")
    extend_block_hashes(hashes, list(range(1, 13)), block_size=4)
    assert len(hashes) == 3


def test_block_pool_evicts_the_least_recently_freed_cached_block():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block_id, name in zip(blocks, (b"a", b"b", b"c")):
        pool.cache_block(block_id, name)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    assert pool.num_free_blocks == 3 and pool.cached_block(b"b") == blocks[1]
    pool.touch([blocks[0]])  # a hit takes a free cached block back out of the queue
    assert pool.allocate(1) == [blocks[1]]  # freed first, so evicted first
    assert pool.cached_block(b"b") is None and pool.cached_block(b"a") == blocks[0]
    pool.cache_block(blocks[1], b"a")  # content already cached elsewhere: the first block keeps the hash
    assert pool.cached_block(b"a") == blocks[0]


def _run_to_end(scheduler) -> None:
    """Finish the batches the test scheduled by hand (oldest first), then schedule and finish the rest."""
    while scheduler.has_unfinished_requests() or scheduler.in_flight:
        if not scheduler.in_flight:
            scheduler.schedule()
        done = {req_id: [7] for req_id, (r, _) in scheduler.in_flight[0].items() if r.num_computed_tokens == r.num_tokens}
        scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids=done))


def test_scheduler_shares_full_prompt_blocks_and_counts_hits():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    scheduler.add_request(make_request(0, prompt_len=10))
    first = scheduler.schedule()
    scheduler.add_request(make_request(1, prompt_len=9))  # same first 9 tokens: blocks 0-1 are full and shared
    scheduler.add_request(make_request(2, prompt_len=8))  # identical 2 blocks: the last token is recomputed
    second = scheduler.schedule()
    [r0] = first.scheduled_new_reqs
    r1, r2 = second.scheduled_new_reqs
    assert r1.num_computed_tokens == 8 and r1.block_ids[:2] == r0.block_ids[:2]
    assert r2.num_computed_tokens == 4 and r2.block_ids[0] == r0.block_ids[0] and r2.block_ids[1] != r0.block_ids[1]
    assert second.num_scheduled_tokens["r1"] == 1 and second.num_scheduled_tokens["r2"] == 4
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 9 + 8, 8 + 4)
    assert scheduler.requests["r1"].num_cached_tokens == 8
    _run_to_end(scheduler)
    assert scheduler.kv.num_free_blocks == 16


def test_requests_in_the_same_step_share_blocks_and_salts_keep_tenants_apart():
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    for i, salt in enumerate((None, None, "tenant-a", "tenant-b", "tenant-a")):
        request = make_request(i, prompt_len=12)
        request.cache_salt = salt
        scheduler.add_request(request)
    out = scheduler.schedule()
    tables = {new.req_id: new.block_ids for new in out.scheduled_new_reqs}
    cached = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    assert cached == {"r0": 0, "r1": 8, "r2": 0, "r3": 0, "r4": 8}
    assert tables["r1"][:2] == tables["r0"][:2] and tables["r4"][:2] == tables["r2"][:2]
    for a, b in (("r0", "r2"), ("r0", "r3"), ("r2", "r3")):
        assert not set(tables[a]) & set(tables[b])
    _run_to_end(scheduler)
    assert scheduler.kv.num_free_blocks == 32


def test_a_preempted_request_resumes_from_its_cached_blocks():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    scheduler.add_request(make_request(0, prompt_len=8, max_tokens=8))
    scheduler.add_request(make_request(1, prompt_len=5, max_tokens=8))
    _run_to_end(scheduler)  # 4 blocks cannot hold both: the later one is preempted and recomputed
    assert scheduler.num_preemptions >= 1 and scheduler.kv.num_free_blocks == 4
    assert scheduler.kv.prefix_cache_hits > 4  # the resumed request found its own blocks again


def test_reset_prefix_cache_forgets_every_block():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    scheduler.add_request(make_request(0, prompt_len=9))
    _run_to_end(scheduler)
    scheduler.kv.reset_prefix_cache()
    scheduler.add_request(make_request(1, prompt_len=9))
    [new] = scheduler.schedule().scheduled_new_reqs
    assert new.num_computed_tokens == 0


def _shared_prefix_prompts(vocab: int) -> list[dict]:
    """Prompts sharing whole blocks, partial blocks, and one identical to an earlier one (block size 16)."""
    [base, tail_a, tail_b] = random_prompts([40, 7, 30], vocab, seed=3)
    prompts = [base, base[:37] + tail_a, base[:16] + tail_b, base, base[:32], base + tail_b]
    return [{"prompt_token_ids": ids} for ids in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_outputs_with_prefix_caching_equal_outputs_without(arch):
    model = tiny_model(arch)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model, dtype="float32", in_process=True, enable_prefix_caching=False)
    cached = LLM(model, dtype="float32", in_process=True, max_num_batched_tokens=64)
    prompts = _shared_prefix_prompts(plain.info.vocab_size)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    # Twice: first the requests share blocks with each other within a run, then with the cached earlier run.
    for run in range(2):
        outputs = cached.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert all(o.num_cached_tokens % 16 == 0 for o in outputs)
        assert sum(o.num_cached_tokens > 0 for o in outputs) >= (3 if run == 0 else len(prompts))
    stats = cached.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries >= 2 * sum(len(p["prompt_token_ids"])
                                                                                  for p in prompts)
    assert cached.reset_prefix_cache() is True
    assert cached.generate(prompts[:1], params, use_tqdm=False)[0].num_cached_tokens == 0
    assert_all_blocks_free(cached)
    assert_all_blocks_free(plain)


def test_eviction_under_a_small_pool_keeps_outputs_exact(llama_model):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(llama_model, dtype="float32", in_process=True, enable_prefix_caching=False)
    # 12 blocks of 16: far too few to keep every prompt's blocks, so cached blocks are evicted (and requests
    # preempted) while prompts that share prefixes come and go.
    small = LLM(llama_model, dtype="float32", in_process=True, num_kv_blocks=12, max_model_len=128,
                max_num_seqs=4)
    vocab = plain.info.vocab_size
    bases = random_prompts([48, 48, 48], vocab, seed=5)
    tails = random_prompts([5] * 12, vocab, seed=6)
    prompts = [{"prompt_token_ids": bases[i % 3] + tails[i]} for i in range(12)]
    roomy = LLM(llama_model, dtype="float32", in_process=True, max_model_len=128, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)] == expected
    assert small.get_stats().prefix_cache_hits > 0
    # Two 128-token requests need every one of the 12 blocks: whatever was cached is evicted, so the first prompt
    # is computed afresh (and still exact), where a roomy pool keeps its 3 full base blocks.
    fillers = [{"prompt_token_ids": p} for p in random_prompts([118, 118], vocab, seed=7)]
    for llm in (small, roomy):
        llm.generate(prompts[:1], params, use_tqdm=False)
        llm.generate(fillers, params, use_tqdm=False)
    [evicted], [kept] = (llm.generate(prompts[:1], params, use_tqdm=False) for llm in (small, roomy))
    assert (evicted.num_cached_tokens, kept.num_cached_tokens) == (0, 48)
    assert evicted.outputs[0].token_ids == kept.outputs[0].token_ids == expected[0]
    assert_all_blocks_free(small)


def test_different_salts_never_share_blocks_end_to_end(llama_model):
    llm = LLM(llama_model, dtype="float32", in_process=True)
    ids = random_prompts([50], llm.info.vocab_size, seed=8)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": ids, "cache_salt": "alice"}, params, use_tqdm=False)[0]
    other = llm.generate({"prompt_token_ids": ids, "cache_salt": "bob"}, params, use_tqdm=False)[0]
    same = llm.generate({"prompt_token_ids": ids, "cache_salt": "alice"}, params, use_tqdm=False)[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, same.num_cached_tokens) == (0, 0, 48)
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": 5}, params, use_tqdm=False)
    assert_all_blocks_free(llm)
