"""Greedy float32 outputs equal HF transformers token for token, however the engine batches them."""
from __future__ import annotations

import functools

import pytest

from conftest import ARCHS, assert_all_blocks_free, random_prompts, tiny_model
from frontend import LLM, SamplingParams
from hf_reference import hf_greedy

# Lengths at and around multiples of 8/16/32 (every block size tested), the single-token prompt, and long ones
# past the mistral test model's 64-token sliding window.
PROMPT_LENGTHS = [1, 7, 15, 16, 17, 31, 32, 33, 64, 100, 255, 300]
MAX_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# Each variant must leave outputs unchanged: batched (default), chunked, preempted, other block sizes.
VARIANTS = {
    "batched": {},
    "chunked": {"max_num_batched_tokens": 5},  # every prompt over 5 tokens is split across steps
    "preempted": {"num_kv_blocks": 24, "max_model_len": 384},
    "block_size_8": {"block_size": 8},
    "block_size_32": {"block_size": 32},
}


@functools.cache
def expected(model_dir: str) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(PROMPT_LENGTHS, vocab=1000)
    return prompts, [hf_greedy(model_dir, p, MAX_NEW_TOKENS) for p in prompts]


def generate(model_dir: str, prompts: list[list[int]], **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, dtype="float32", **engine_args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert_all_blocks_free(llm)
    return [o.outputs[0].token_ids for o in outputs], llm


# The default run: every variant on llama, plain batching on each family, and mistral's sliding window chunked and
# preempted; the other families' variants repeat llama's paths and run with -m slow.
CASES = [pytest.param(arch, variant, id=f"{arch}-{variant}", marks=() if arch == "llama" or variant == "batched" or (
             arch == "mistral" and variant in ("chunked", "preempted")) else pytest.mark.slow)
         for arch in ARCHS for variant in VARIANTS]


@pytest.mark.parametrize("arch, variant", CASES)
def test_greedy_equals_hf(arch, variant):
    model_dir = tiny_model(arch)
    prompts, hf_outputs = expected(model_dir)
    outputs, llm = generate(model_dir, prompts, **VARIANTS[variant])
    for length, ours, theirs in zip(PROMPT_LENGTHS, outputs, hf_outputs):
        assert ours == theirs, f"{arch}/{variant}: prompt of {length} tokens diverges from HF"
    if variant == "preempted":
        assert llm.get_stats().num_preemptions > 0


def test_each_prompt_alone_equals_hf(arch_model):
    arch, model_dir = arch_model
    prompts, hf_outputs = expected(model_dir)
    llm = LLM(model_dir, dtype="float32")
    for prompt, theirs in zip(prompts, hf_outputs):
        [output] = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == theirs, f"{arch}: prompt of {len(prompt)} tokens alone"
    assert_all_blocks_free(llm)


def test_sliding_window_is_exercised():
    """Same weights without the window: short prompts agree, the ones past the window do not."""
    from pathlib import Path

    from launch.make_model import make_model

    windowed = tiny_model("mistral")
    unwindowed = str(make_model(Path(windowed).parent / "mistral-tiny-full", arch="mistral", size="tiny",
                                sliding_window=None))
    prompts, hf_outputs = expected(windowed)
    full, _ = generate(unwindowed, prompts)
    window = 64
    for length, ours, theirs in zip(PROMPT_LENGTHS, full, hf_outputs):
        if length + MAX_NEW_TOKENS <= window:
            assert ours == theirs, f"prompt of {length} tokens never reaches the window, so it must agree"
    assert any(ours != theirs for ours, theirs in zip(full, hf_outputs)), "the window changed nothing"
