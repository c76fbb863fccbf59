"""Bad input raises ValueError naming the field, before anything is queued."""
from __future__ import annotations

import sys

import pytest

from conftest import assert_all_blocks_free, tiny_model
from frontend import LLM, SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0),
    ("min_tokens", -1), ("n", 0), ("logprobs", 2000), ("stop", [""]), ("seed", "7"), ("stop_token_ids", [-1]),
    ("temperature", "hot"), ("ignore_eos", None), ("seed", 2**64), ("output_kind", "streaming"),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


@pytest.fixture(scope="module")
def llm(llama_model):
    llm = LLM(llama_model, dtype="float32", max_model_len=64)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": list(range(64))}, r"context length \(max_model_len\) is 64"),
    ({"prompt_token_ids": [1, 99999]}, "outside the vocabulary"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
    (42, "prompt must be"),
])
def test_bad_prompts_raise_and_queue_nothing(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)
    assert not llm.router.has_requests() and not llm.router.output_processor.states


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_over_the_engines_max_logprobs_are_refused(llm, field):
    assert llm.info.max_logprobs == 20
    with pytest.raises(ValueError, match=f"{field}=21 is over this engine's limit of 20"):
        llm.generate(["a"], SamplingParams(max_tokens=2, **{field: 21}), use_tqdm=False)
    [output] = llm.generate(["a"], SamplingParams(max_tokens=2, **{field: 20}), use_tqdm=False)
    assert output.outputs[0].finish_reason == "length"


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 1])
    assert_all_blocks_free(llm)


def test_prompt_at_limit_is_accepted_and_stops_at_max_model_len(llm):
    [output] = llm.generate({"prompt_token_ids": list(range(60))}, SamplingParams(max_tokens=50, ignore_eos=True),
                            use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4 and output.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, field", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
    ({"max_model_len": 100000}, "max_model_len"),
    ({"dtype": "int3"}, "dtype"),
    ({"block_size": 12}, "block_size"),
    ({"num_kv_blocks": 2, "max_model_len": 512}, "max_model_len"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"max_num_seq": 4}, "max_num_seq"),
])
def test_bad_engine_arguments(llama_model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(llama_model, **kwargs)


@pytest.mark.parametrize("arch, kwargs, message", [
    ("llama", {"tensor_parallel_size": 3}, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
    ("llama", {"pipeline_parallel_size": 64}, "pipeline_parallel_size=64 exceeds the model's"),
    ("opt", {"tensor_parallel_size": 3}, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
])
def test_parallel_sizes_the_model_cannot_take_are_refused_before_ray_starts(arch, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model(arch), in_process=True, **kwargs)
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_unknown_model_folder(tmp_path):
    with pytest.raises(ValueError, match="model .* is not a model folder"):
        LLM(str(tmp_path / "no-such-model"))


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids token id 99999 is outside the vocabulary"):
        llm.generate("hi", SamplingParams(stop_token_ids=[99999], min_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)
    assert len(llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 3
