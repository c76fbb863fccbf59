"""The encoder budget (issue 54): a step encodes at most max_num_encoder_input_tokens of image features, a prompt's
chunk stopping before the image that would overspend it; an image larger than the budget runs in a step of its own;
images whose placeholders the prefix cache holds cost nothing; outputs stay exact under a tight budget."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_blocks_free, tiny_llava
from core.encoder_budget import chunk_within_encoder_budget
from core.kv_cache_manager import KVCacheManager
from core.request import Request
from core.scheduler import Scheduler
from frontend import LLM
from ipc import EngineConfig, EngineCoreRequest, SamplingParams
from ipc.multimodal import ImageInput
from scheduler_steps import run_step
from workers.model_config import load_hf_config
from vision import FEATURES, hf_greedy, picture

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = {"dtype": "float32", "block_size": 8, "max_model_len": 256}


def image_request(i: int, prompt_len: int, offsets: list[int], length: int = 25) -> Request:
    images = [ImageInput.of(torch.full((3, 2, 2), float(i * 10 + n)), offset, length)
              for n, offset in enumerate(offsets)]
    core = EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=list(range(prompt_len)),
                             sampling_params=SamplingParams(max_tokens=2, ignore_eos=True), mm_inputs=images)
    return Request(core, arrival_index=i, max_tokens=2)


def scheduler(encoder_tokens: int, batched_tokens: int = 64) -> Scheduler:
    config = EngineConfig(model="unused", block_size=4, max_model_len=256, max_num_batched_tokens=batched_tokens,
                          max_num_encoder_input_tokens=encoder_tokens)
    return Scheduler(config, KVCacheManager(64, 4, True))


def test_a_chunk_stops_before_the_image_that_would_overspend_the_step():
    sched = scheduler(encoder_tokens=30)
    sched.add_request(image_request(0, 40, [5]))
    sched.add_request(image_request(1, 60, [0, 30]))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 40}  # r1's first image (25) does not fit the 5 left
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 30}  # r1 up to its second image
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r1": 30}


def test_an_image_larger_than_the_budget_runs_alone_and_a_preempted_request_pays_again():
    sched = scheduler(encoder_tokens=10)
    request = image_request(0, 60, [0, 30])
    sched.add_request(request)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 30} and request.num_encoded_images == 1
    sched._preempt(request)
    assert request.num_encoded_images == 0
    # Back from the prefix cache's 28 tokens: the first image's placeholders all cached, the second paid for.
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 32} and request.num_encoded_images == 2


def test_images_the_prefix_cache_holds_cost_nothing():
    request = image_request(0, 80, [0, 30, 60])
    # Tokens from 40 on: the first image is cached whole, the second in part (its features are needed again).
    assert chunk_within_encoder_budget(request, 40, 40, budget=25, untouched=False) == (20, 25)
    assert chunk_within_encoder_budget(request, 40, 40, budget=50, untouched=False) == (40, 50)
    assert chunk_within_encoder_budget(request, 40, 40, budget=10, untouched=True) == (20, 25)


def test_outputs_are_exact_under_an_encoder_budget_of_one_image_a_step():
    """Prompts of 54 and 53 tokens with two 25-feature images each: the budget cuts the first before its second
    image and holds the second back a step."""
    from transformers import AutoImageProcessor
    from transformers import LlavaForConditionalGeneration as HFLlava

    reference = (HFLlava.from_pretrained(tiny_llava(), dtype=torch.float32).eval(),
                 AutoImageProcessor.from_pretrained(tiny_llava()))
    engine = LLM(tiny_llava(), in_process=True, **ENGINE, max_num_batched_tokens=64,
                 max_num_encoder_input_tokens=FEATURES)
    try:
        image_id = engine.info.image_token_id
        prompts = [[5, image_id, 9, 11, image_id, 3], [image_id, 4, image_id, 8, 2]]
        pictures = [[picture(1), picture(2, 30, 61)], [picture(3, 70, 40), picture(1)]]
        outputs = engine.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                                   for ids, images in zip(prompts, pictures)], GREEDY)
        for images, output in zip(pictures, outputs):
            assert output.outputs[0].token_ids == hf_greedy(reference, output.prompt_token_ids, images, 8)
        assert engine.client.engine.executor.worker.model_runner.encoder_cache.num_encoded == 3  # picture(1) once
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_the_encoder_cache_keeps_what_encoder_cache_memory_allows():
    hidden = load_hf_config(tiny_llava()).get_text_config().hidden_size
    per_image = FEATURES * hidden * 4  # float32 features
    engine = LLM(tiny_llava(), in_process=True, **ENGINE, max_num_batched_tokens=16,
                 encoder_cache_memory=f"{2 * per_image}B")
    try:
        cache = engine.client.engine.executor.worker.model_runner.encoder_cache
        assert cache.max_bytes == 2 * per_image
        for seed in (1, 2, 3, 1):  # the third evicts the first, which is encoded again
            engine.generate({"prompt": "<image> hi", "multi_modal_data": {"image": picture(seed)}}, GREEDY,
                            use_tqdm=False)
        assert cache.num_encoded == 4 and len(cache.entries) == 2 and cache.num_bytes == 2 * per_image
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="encoder_cache_memory: cannot parse '2 potatoes'"):
        EngineConfig(model="unused", encoder_cache_memory="2 potatoes")
