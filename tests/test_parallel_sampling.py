"""Parallel sampling (n > 1): n distinct samples whose prompt blocks are shared, offline and streamed."""
from __future__ import annotations

import asyncio

import pytest

from conftest import assert_all_blocks_free, random_prompts
from frontend import LLM, AsyncLLM, SamplingParams
from ipc import RequestOutputKind

PROMPT = {"prompt_token_ids": random_prompts([100], vocab=1000, seed=21)[0]}
SAMPLED = dict(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)


def _peak_blocks(llm: LLM, requests: list[SamplingParams]) -> int:
    llm.generate([PROMPT] * len(requests), requests, use_tqdm=False)
    stats = llm.get_stats()
    assert_all_blocks_free(llm)
    return round(stats.peak_kv_cache_usage * llm.info.num_kv_blocks)


def test_n_samples_are_distinct_reproducible_and_share_prompt_blocks(llama_model):
    llm = LLM(llama_model, dtype="float32", in_process=True)
    [output] = llm.generate(PROMPT, SamplingParams(n=4, **SAMPLED), use_tqdm=False)
    samples = [tuple(c.token_ids) for c in output.outputs]
    assert [c.index for c in output.outputs] == [0, 1, 2, 3] and len(set(samples)) == 4
    assert all(len(s) == 12 for s in samples) and output.finished
    [again] = llm.generate(PROMPT, SamplingParams(n=4, **SAMPLED), use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == samples  # seeds seed, seed+1, ...
    [single] = llm.generate(PROMPT, SamplingParams(**SAMPLED), use_tqdm=False)
    assert tuple(single.outputs[0].token_ids) == samples[0]
    llm.shutdown()
    # Peak KV blocks: n=4 shares the prompt's 6 full blocks; 4 requests without prefix caching hold 4 copies.
    shared = _peak_blocks(LLM(llama_model, dtype="float32", in_process=True), [SamplingParams(n=4, **SAMPLED)])
    separate = _peak_blocks(LLM(llama_model, dtype="float32", in_process=True, enable_prefix_caching=False),
                            [SamplingParams(**SAMPLED, )] * 4)
    assert shared == 6 + 4 and separate == 4 * 7, (shared, separate)


def test_async_llm_streams_each_sample_and_a_final_merged_output(llama_model):
    async def run():
        engine = AsyncLLM(llama_model, dtype="float32")
        try:
            delta = SamplingParams(n=2, output_kind=RequestOutputKind.DELTA, **SAMPLED)
            texts, finished = {0: [], 1: []}, []
            async for output in engine.generate(PROMPT, delta):
                [completion] = output.outputs
                texts[completion.index] += completion.token_ids
                finished.append(output.finished)
            final = SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY, **SAMPLED)
            outputs = [output async for output in engine.generate(PROMPT, final)]
            return texts, finished, outputs
        finally:
            engine.shutdown()
    texts, finished, outputs = asyncio.run(run())
    assert finished[-1] and not any(finished[:-1]) and len(texts[0]) == len(texts[1]) == 12
    [merged] = outputs
    assert [c.token_ids for c in merged.outputs] == [texts[0], texts[1]] and texts[0] != texts[1]


def test_engine_requests_sample_once():
    from ipc import EngineCoreRequest, EngineInfo
    info = EngineInfo(model="m", max_model_len=64, vocab_size=100, num_kv_blocks=8, block_size=16,
                      scheduling_policy="fcfs")
    with pytest.raises(ValueError, match="n > 1 as n requests"):
        info.validate_request(EngineCoreRequest(request_id="a", prompt_token_ids=[1],
                                                sampling_params=SamplingParams(n=2)))
