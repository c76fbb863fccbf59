"""Copies of bf16 weights for the CPU's products (workers.prepacking): prepacked for torch's GEMMs
(kernels.cpu_prepacked: the same products) and paired for the GEMV kernel (kernels.cpu_gemv.pair_weight: the same
products summed in another order), kept only within the memory budget, and the engine's outputs with them."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts, tiny_model

from frontend import LLM, SamplingParams
from kernels import cpu_gemv, cpu_prepacked
from kernels.cpu_features import cpu_has_native_bf16
from workers import prepacking
from workers.layers.fused_moe import FusedMoE
from workers.layers.linear import Linear
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from workers.model_config import load_hf_config
from workers.model_loader import load_model


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.skipif(not cpu_has_native_bf16(), reason="oneDNN's bf16 prepacking needs AVX-512 BF16 (or "
                    "AVX-NE-CONVERT); the engine prepacks only where bf16 GEMMs run natively")
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
    """Paired copies first (where the CPU has AVX-512 BF16), then prepacked ones (where torch's bf16 GEMMs run in
    bf16), each kind only if every copy so far (counted in its own bytes) fits 1/8 of the memory available."""
    model = _bf16_model()
    linears = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert any(isinstance(m, Linear) for m in linears) and isinstance(model.lm_head, ParallelLMHead)

    def copies(available: int) -> tuple[int, set[bool], set[bool]]:
        for m in linears:
            m.packed_weight = m.pairs_weight = None
        copied = prepacking.prepack_linear_weights(model, available_bytes=available)
        return copied, {m.pairs_weight is not None for m in linears}, {m.packed_weight is not None for m in linears}

    weight_bytes = sum(m.weight.nbytes for m in linears)
    paired = cpu_gemv.pairs_cpu()
    pairs_bytes = sum(math.prod(cpu_gemv.pairs_shape(m.weight)) * 2 for m in linears) if paired else 0
    prepacked = cpu_has_native_bf16() and torch.backends.mkldnn.is_available()  # else bf16 GEMMs run as float32
    assert pairs_bytes >= weight_bytes or not paired  # (rows padded to tiles of 32)
    fraction = prepacking.PREPACK_MEMORY_FRACTION
    assert copies(weight_bytes) == (0, {False}, {False})  # over 1/8 of it
    assert copies(int(pairs_bytes / fraction) + 1) == (pairs_bytes, {paired}, {not paired and prepacked})
    both = pairs_bytes + prepacked * weight_bytes
    assert copies(int(both / fraction) + 1) == (both, {paired}, {prepacked})
    pairs = model.lm_head.pairs_weight
    assert (pairs is not None) == paired and (pairs is None or cpu_gemv.fits_pairs(model.lm_head.weight, pairs))
    embedding = model.model.embed_tokens
    assert isinstance(embedding, VocabParallelEmbedding) and not hasattr(embedding, "packed_weight")  # a lookup


@pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="paired copies need AVX-512 BF16")
def test_experts_stacks_are_paired_within_the_pairs_budget():
    """A mixture of experts' stacked weights get each expert's paired copy, stacked, with the linear layers' and
    counted in their budget: all of them or none."""
    model = tiny_model("mixtral")
    loaded = load_model(model, load_hf_config(model), torch.bfloat16, torch.device("cpu"))
    linears = [m for m in loaded.modules() if hasattr(m, "pairs_weight")]
    moes = [m for m in loaded.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.gate_up_pairs is not None and m.down_pairs is not None for m in moes)

    def paired(available: int) -> set[bool]:
        """Which of the linear layers and experts' stacks got paired copies within that budget."""
        for m in linears:
            m.packed_weight = m.pairs_weight = None
        for m in moes:
            m.gate_up_pairs = m.down_pairs = None
        prepacking.prepack_linear_weights(loaded, available_bytes=available)
        return {m.pairs_weight is not None for m in linears} | {p is not None for m in moes
                                                               for p in (m.gate_up_pairs, m.down_pairs)}

    stacks = [m.gate_up_proj for m in moes] + [m.down_proj for m in moes]
    pairs_bytes = sum(math.prod(cpu_gemv.pairs_shape(m.weight)) * 2 for m in linears) + sum(
        len(stack) * math.prod(cpu_gemv.pairs_shape(stack[0])) * 2 for stack in stacks)
    assert paired(int(pairs_bytes / prepacking.PREPACK_MEMORY_FRACTION) - 1) == {False}
    assert paired(int(pairs_bytes / prepacking.PREPACK_MEMORY_FRACTION) + 1) == {True}
    for moe in moes:
        for stack, pairs in ((moe.gate_up_proj, moe.gate_up_pairs), (moe.down_proj, moe.down_pairs)):
            assert torch.equal(pairs, torch.stack([cpu_gemv.pair_weight(w) for w in stack]))


def test_float32_weights_are_not_packed():
    model = tiny_model("llama")
    loaded = load_model(model, load_hf_config(model), torch.float32, torch.device("cpu"))
    assert all(getattr(m, name, None) is None for m in loaded.modules()
               for name in ("packed_weight", "pairs_weight", "gate_up_pairs", "down_pairs"))


PROMPTS = [{"prompt_token_ids": p} for p in random_prompts([40, 90, 17, 60] * 10, vocab=1000, seed=3)]


def _greedy_run(copy: str) -> tuple[list[tuple[list[int], list[dict]]], int]:
    """bf16 greedy with prompts and decode batches past every kernel's rows: each output's tokens and logprobs, and
    how many layers kept a `copy`."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    llm = LLM(tiny_model("llama"), dtype="bfloat16", in_process=True)
    try:
        model = llm.client.engine.executor.worker.model_runner.model
        copies = sum(getattr(m, copy, None) is not None for m in model.modules())
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outputs], copies
    finally:
        llm.shutdown()


def test_engine_outputs_equal_without_prepacked_copies(monkeypatch):
    """torch's GEMMs from prepacked copies compute the same products: the same tokens and logprobs bit for bit."""
    monkeypatch.setattr(cpu_gemv, "pairs_serve", lambda weight: False)
    packed, copies = _greedy_run("packed_weight")
    monkeypatch.setattr(prepacking, "PREPACK_MEMORY_FRACTION", 0.0)
    plain, none = _greedy_run("packed_weight")
    assert none == 0 and (copies > 0) == (cpu_has_native_bf16() and torch.backends.mkldnn.is_available())
    assert packed == plain


@pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="paired copies need AVX-512 BF16")
def test_engine_outputs_with_paired_copies_differ_at_most_by_rounding(monkeypatch):
    """The paired copies' products sum each output in another order than the plain kernels (both round float32 sums
    once to bf16): greedy tokens agree and the logprobs of the tokens both chose within bf16 rounding."""
    paired, copies = _greedy_run("pairs_weight")
    monkeypatch.setattr(prepacking, "PREPACK_MEMORY_FRACTION", 0.0)
    plain, none = _greedy_run("pairs_weight")
    assert copies > 0 and none == 0
    assert_agree_within_rounding(paired, plain, 0.9)


def assert_agree_within_rounding(runs: list[tuple[list[int], list[dict]]], others: list[tuple[list[int], list[dict]]],
                                 share: float) -> None:
    """Greedy (tokens, logprobs) of the same prompts by products summed in two orders: at least `share` of the
    outputs have the same tokens, and the logprob of each token both chose (up to the first that differs) agrees
    within bf16 rounding."""
    agree = 0
    for (tokens, logprobs), (other_tokens, other_logprobs) in zip(runs, others, strict=True):
        agree += tokens == other_tokens
        for token, other_token, step, other_step in zip(tokens, other_tokens, logprobs, other_logprobs):
            if token != other_token:
                break
            assert step[token] == pytest.approx(other_step[token], abs=0.05)
    assert agree >= share * len(runs)
