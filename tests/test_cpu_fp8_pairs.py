"""fp8 e4m3 weights from their pairs copy (kernels/cpu_fp8_pairs.py, kernels/csrc/fp8_pairs.h; issue 52: FP8 block
checkpoints' batch-1 decode as fast as int8's): equal to the dequantized twin and to the plain fp8 kernel within one
bf16 rounding, every byte read exactly, a row's result the same at any row count; a bf16 engine on an FP8 block
checkpoint keeps the copies and runs its C++ layer from them with the plain kernel's tokens."""
from __future__ import annotations

import pytest
import torch
from conftest import _MODEL_ROOT, random_prompts, tiny_model
from quantized_checkpoints import fp8_block_checkpoint
from test_cpu_gemv_fp8 import E4M3_FINITE, fp8_weight
from test_prepacking import assert_agree_within_rounding

from frontend import LLM, SamplingParams
from kernels import cpu_decoder_layer, cpu_extension, cpu_fp8_pairs, cpu_gemv
from kernels.quantized_matmul import dequantize, linear_reference

pytestmark = pytest.mark.skipif(
    not cpu_fp8_pairs.pairs_serve(torch.zeros(1, 16, dtype=torch.float8_e4m3fn), torch.ones(1)),
    reason="fp8 pairs copies need AVX-512 BF16 and VBMI")


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


# 1 row: converted in registers; more: a tile converted once, rows 4 at a time (5 and 33: a last group of 1).
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 33, 64])
# (N, K, groups): a last partial tile of rows, groups of 8, 16 and 128 columns, a scale per row.
@pytest.mark.parametrize("shape", [(67, 96, 0), (67, 96, 6), (130, 256, 2), (45, 40, 5), (32, 512, 4)])
def test_pairs_products_equal_the_twin_and_the_plain_kernel(rows, shape):
    out_features, in_features, groups = shape
    generator = torch.Generator().manual_seed(rows * 100 + out_features + groups)
    weight, scale = fp8_weight(out_features, in_features, groups, generator)
    pairs = cpu_fp8_pairs.pair_fp8(weight, scale)
    assert cpu_fp8_pairs.fits_pairs(weight, scale, pairs)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    for b in (None, bias):
        out = cpu_fp8_pairs.linear(x, weight, scale, b, pairs)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        tolerance = {"rtol": 2**-7, "atol": 1e-2}
        torch.testing.assert_close(out.float(), linear_reference(x, weight, scale, bias=b).float(), **tolerance)
        torch.testing.assert_close(out.float(), cpu_gemv.gemv_quantized(x, weight, scale, b).float(), **tolerance)
        alone = torch.cat([cpu_fp8_pairs.linear(x[i:i + 1], weight, scale, b, pairs) for i in range(rows)])
        assert torch.equal(alone, out)  # the same sums in the same order at any row count


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("groups", [0, 2])
def test_every_fp8_byte_reads_as_its_value(rows, groups):
    """Weight row i holds byte i in one column and zeros elsewhere: each output is that byte's value times its
    scale, exactly (subnormals and negative zero included)."""
    codes = torch.tensor(E4M3_FINITE, dtype=torch.uint8)
    weight = torch.zeros(len(codes), 16, dtype=torch.uint8)
    weight[:, 3] = codes
    weight = weight.view(torch.float8_e4m3fn)
    scale = torch.full((len(codes), *((groups,) if groups else ())), 0.5)
    x = torch.zeros(rows, 16, dtype=torch.bfloat16)
    x[:, 3] = 1.0
    out = cpu_fp8_pairs.linear(x, weight, scale, None, cpu_fp8_pairs.pair_fp8(weight, scale))
    assert torch.equal(out, (dequantize(weight, scale)[:, 3].expand(rows, -1)).to(torch.bfloat16))


def test_copies_that_do_not_fit_are_refused_by_name():
    weight, scale = fp8_weight(40, 64, 2, torch.Generator().manual_seed(0))
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match="pair_fp8"):
        cpu_fp8_pairs.linear(x, weight, scale, None, cpu_fp8_pairs.pair_fp8(weight, scale)[:-4])
    with pytest.raises(ValueError, match="pair_fp8"):
        cpu_fp8_pairs.linear(x.float(), weight, scale, None, cpu_fp8_pairs.pair_fp8(weight, scale))
    assert not cpu_fp8_pairs.takes(weight, torch.ones(40, 3))  # 64 columns in 3 groups


def _greedy(quantized: str, prompts: list[list[int]]) -> tuple[list[tuple[list[int], list[dict]]], int]:
    """bf16 greedy tokens and logprobs of each prompt, and how many fp8 linear layers kept a pairs copy."""
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    llm = LLM(quantized, dtype="bfloat16", in_process=True, block_size=8)
    try:
        model = llm.client.engine.executor.worker.model_runner.model
        fp8 = [m for m in model.modules() if getattr(m, "weight", None) is not None
               and m.weight.dtype == torch.float8_e4m3fn]
        assert fp8
        copies = sum(m.pairs_weight is not None for m in fp8)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outputs], copies
    finally:
        llm.shutdown()


def test_a_bf16_engine_runs_its_fp8_layers_from_the_copies(monkeypatch):
    """Every fp8 layer of an FP8 block checkpoint (blocks of 16 columns) keeps its pair_fp8 copy and the C++ layer
    reads it (prefill chunks and decodes of up to 5 rows); tokens and logprobs agree with the plain fp8 kernel's within bf16 rounding
    (the copies' sums run in another order)."""
    quantized, _ = fp8_block_checkpoint(tiny_model("llama"), _MODEL_ROOT / "llama-tiny-fp8-blocks-24x16", (24, 16))
    prompts = random_prompts([3, 40, 17, 9, 26], vocab=1000, seed=11)
    layer_calls = []
    layers = cpu_decoder_layer.decoder_layers
    monkeypatch.setattr(cpu_decoder_layer, "decoder_layers", lambda *a, **kw: layer_calls.append(1) or layers(*a, **kw))
    paired, copies = _greedy(quantized, prompts)
    assert layer_calls and copies > 0
    monkeypatch.setattr(cpu_fp8_pairs, "pairs_serve", lambda weight, scale: False)
    plain, none = _greedy(quantized, prompts)
    assert none == 0
    assert_agree_within_rounding(paired, plain, 0.8)
