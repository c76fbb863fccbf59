"""Layers against their plain torch twins: the bf16 linear path, RMSNorm, rotary; and bf16 end to end."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompts
from frontend import LLM, SamplingParams
from workers.layers.linear import linear


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_equals_torch_bf16_linear(bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=generator).bfloat16()
    weight = torch.randn(80, 96, generator=generator).bfloat16()
    b = torch.randn(80, generator=generator).bfloat16() if bias else None
    ours = linear(x, weight, b)
    assert ours.dtype == torch.bfloat16
    reference = F.linear(x.double(), weight.double(), b.double() if bias else None)
    # Both round one float32-accumulated result to bf16: within one bf16 ulp of the exact product.
    torch.testing.assert_close(ours.double(), reference, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(ours, F.linear(x, weight, b), rtol=2**-7, atol=1e-2)


def test_bfloat16_engine_logprobs_close_to_hf_float32(llama_model):
    from hf_reference import _hf_model

    prompts = random_prompts([12, 50, 130], vocab=1000, seed=9)
    llm = LLM(llama_model, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        with torch.inference_mode():
            logits = _hf_model(llama_model)(torch.tensor([prompt + completion.token_ids])).logits[0]
        reference = logits.float().log_softmax(-1)[len(prompt) - 1:len(prompt) + 3]
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert abs(entry[token].logprob - reference[step, token].item()) < 0.15
