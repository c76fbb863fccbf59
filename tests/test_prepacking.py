"""Prepacked bf16 weights for torch's CPU GEMMs (kernels.cpu_prepacked, workers.prepacking): the same products, kept
only within the memory budget, and the same engine outputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompts, tiny_model
from frontend import LLM, SamplingParams
from kernels import cpu_prepacked
from kernels.cpu_features import cpu_has_native_bf16
from workers import prepacking
from workers.layers.linear import Linear
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from workers.model_config import load_hf_config
from workers.model_loader import load_model


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 9, 33, 96, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_products_equal_f_linear(rows, bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=generator).bfloat16()
    b = torch.randn(200, generator=generator).bfloat16() if bias else None
    packed = cpu_prepacked.prepack(weight)
    for x in (torch.randn(rows, 96, generator=generator).bfloat16(),
              torch.randn(3, rows, 96, generator=generator).bfloat16(),  # leading dimensions
              torch.randn(rows, 192, generator=generator).bfloat16()[:, ::2]):  # strided rows
        assert torch.equal(cpu_prepacked.linear(x, packed, b), F.linear(x, weight, b))


def _bf16_model() -> torch.nn.Module:
    model = tiny_model("llama")
    return load_model(model, load_hf_config(model), torch.bfloat16, torch.device("cpu"))


def test_copies_are_kept_only_within_the_memory_budget():
    model = _bf16_model()
    linears = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert any(isinstance(m, Linear) for m in linears) and isinstance(model.lm_head, ParallelLMHead)
    for m in linears:
        m.packed_weight = None
    weight_bytes = sum(m.weight.nbytes for m in linears)
    assert prepacking.prepack_linear_weights(model, available_bytes=weight_bytes) == 0  # over 1/8 of it
    assert all(m.packed_weight is None for m in linears)
    budget = int(weight_bytes / prepacking.PREPACK_MEMORY_FRACTION)
    packed = prepacking.prepack_linear_weights(model, available_bytes=budget)
    expected = cpu_has_native_bf16() and torch.backends.mkldnn.is_available()  # else bf16 GEMMs run as float32
    assert packed == (weight_bytes if expected else 0)
    assert all((m.packed_weight is not None) == expected for m in linears)
    assert model.lm_head.packed_weight is not None or not expected
    embedding = model.model.embed_tokens
    assert isinstance(embedding, VocabParallelEmbedding) and not hasattr(embedding, "packed_weight")  # a lookup


def test_float32_weights_are_not_packed():
    model = tiny_model("llama")
    loaded = load_model(model, load_hf_config(model), torch.float32, torch.device("cpu"))
    assert all(getattr(m, "packed_weight", None) is None for m in loaded.modules())


def test_engine_outputs_equal_without_copies(monkeypatch):
    """bf16 greedy with prompts and decode batches past the kernels' rows (torch's GEMMs run the products): the same
    tokens and logprobs whether the model keeps prepacked copies or not."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([40, 90, 17, 60] * 10, vocab=1000, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)

    def run() -> tuple[list, int]:
        llm = LLM(tiny_model("llama"), dtype="bfloat16", in_process=True)
        try:
            model = llm.client.engine.executor.worker.model_runner.model
            copies = sum(getattr(m, "packed_weight", None) is not None for m in model.modules())
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs])
                    for o in outputs], copies
        finally:
            llm.shutdown()

    packed, copies = run()
    monkeypatch.setattr(prepacking, "PREPACK_MEMORY_FRACTION", 0.0)
    plain, none = run()
    assert none == 0 and (copies > 0) == (cpu_has_native_bf16() and torch.backends.mkldnn.is_available())
    assert packed == plain
