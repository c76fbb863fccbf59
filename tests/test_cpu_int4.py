"""4-bit weights (GPTQ, AWQ, compressed-tensors) in the C++ kernels and layer: the product against the dequantized
weight, the layer against its own op path, and 4-bit checkpoints on the fused multi-step path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_all_blocks_free, random_prompts
from frontend import LLM, SamplingParams
from hf_reference import hf_greedy
from kernels import cpu_decoder_layer, cpu_extension, cpu_gemv, cpu_int4, cpu_projections
from kernels.quantized_matmul import dequantize, linear_reference, pack_int4
from quantized_checkpoints import checkpoint
from tests.test_cpu_decoder_layer import CASES, assert_fused_matches, fused_and_op_by_op, make_layer
from workers.fast_path.later_step_calls import LaterStepCalls
from workers.layers.linear import ColumnParallelLinear, Linear
from workers.prepacking import prepack_linear_weights

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PAIRS = pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="4-bit pairs copies: bf16 rows on CPUs with AVX-512 BF16")


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def random_int4(rows: int, columns: int, groups: int, zeros: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = pack_int4(torch.randint(0, 16, (rows, columns), generator=generator, dtype=torch.uint8))
    scale = 0.001 + 0.02 * torch.rand(rows, groups, generator=generator)
    scale = scale[:, 0].contiguous() if groups == 1 else scale
    zero = torch.randint(0, 16, scale.shape, generator=generator).float() if zeros else None
    return weight, scale, zero


@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("shape, groups, zeros", [((70, 256), 2, True), ((64, 384), 1, False), ((33, 128), 8, True)])
@pytest.mark.parametrize("dtype, paired", [(torch.float32, False), (torch.bfloat16, False),
                                           pytest.param(torch.bfloat16, True, marks=PAIRS)])
def test_int4_product_equals_the_dequantized_weights(rows, shape, groups, zeros, dtype, paired):
    """F.linear on dequantize(...) in the rows' dtype (the op path's weight: (q - zero) * scale in float32, rounded
    once), the sums in other orders: within float32 ulps, or one bf16 rounding of the output (N not a multiple of
    32: a partial last tile); and linear_reference within the quantized linear paths' tolerance."""
    weight, scale, zero = random_int4(*shape, groups, zeros)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, shape[1], generator=generator).to(dtype)
    bias = torch.randn(shape[0], generator=generator).to(dtype)
    pairs = cpu_int4.pair_int4(weight, scale, zero) if paired else None
    got = cpu_int4.linear(x, weight, scale, zero, bias, pairs)
    expected = F.linear(x.float(), dequantize(weight, scale, zero, dtype=dtype).float(), bias.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    reference = linear_reference(x, weight, scale, zero, None, bias)  # float32 weights: as the quantized linear paths
    torch.testing.assert_close(got.float(), reference, **({"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32
                                                          else {"atol": 0.15, "rtol": 2e-2}))


def test_int4_weights_the_kernels_decline_and_bad_pairs():
    weight, scale, zero = random_int4(8, 48, 3, True)  # groups of 16
    assert cpu_int4.takes(weight, scale, zero) and cpu_projections.takes_projection(weight, scale, zero, None)
    odd_groups = torch.rand(8, 16)  # groups of 3 columns: a column pair would span two
    permuted = torch.randperm(48).to(torch.int32) // 16
    assert not cpu_projections.takes_projection(weight, odd_groups, None, None)
    assert not cpu_projections.takes_projection(weight, scale, zero, permuted)  # act-order: the op path
    assert not cpu_int4.takes(weight, scale.half(), zero)
    with pytest.raises(ValueError, match="pair_int4"):
        cpu_int4.linear(torch.randn(1, 48), weight, scale, zero, pairs=torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="4-bit projection"):
        cpu_int4.linear(torch.randn(1, 48), weight, odd_groups)


def quantize_int4(model: torch.nn.Module, zeros: bool) -> None:
    """Every projection to 4-bit per group of 32 columns (8 where 32 does not divide them: the llama case's 344):
    min-max with zero points, or symmetric around 8."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, Linear)):
            weight = module.weight.data.float()
            group = 32 if weight.shape[1] % 32 == 0 else 8
            grouped = weight.view(weight.shape[0], -1, group)
            if zeros:
                low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
                scale = ((high - low) / 15).clamp(min=1e-8)
                zero = torch.round(-low / scale).clamp(0, 15)
            else:
                scale, zero = (grouped.abs().amax(-1) / 7).clamp(min=1e-8), torch.full(grouped.shape[:2], 8.0)
            q = torch.round(grouped / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)
            module.weight = torch.nn.Parameter(pack_int4(q.reshape(weight.shape)), requires_grad=False)
            module.weight_scale, module.weight_zero = scale, zero if zeros else None


@pytest.mark.parametrize("dtype, paired", [(torch.float32, False), (torch.bfloat16, False),
                                           pytest.param(torch.bfloat16, True, marks=PAIRS)])
@pytest.mark.parametrize("seqs", [[(1, 1)], [(9, 1), (70, 5), (130, 3)]], ids=["one decode", "mixed"])
@pytest.mark.parametrize("zeros", [True, False], ids=["zero points", "symmetric"])
def test_int4_projections_equal_the_layers_own_forward(dtype, paired, seqs, zeros):
    """The C++ layer reads each projection as 4-bit, from its pairs copy where
    workers.prepacking gives one, and equals the op path's layer (its tiles dequantized in torch)."""
    layer_class, config = CASES["llama head_dim 64"]
    layer = make_layer(layer_class, config, dtype, seed=3)
    exact = None
    if dtype == torch.bfloat16:
        exact = make_layer(layer_class, config, torch.float32, seed=0)
        exact.load_state_dict({name: value.float() for name, value in layer.state_dict().items()})
        quantize_int4(exact, zeros)
    quantize_int4(layer, zeros)
    if paired:
        prepack_linear_weights(layer, available_bytes=1 << 40)
        assert layer.self_attn.qkv_proj.pairs_weight.dtype == torch.uint8
    assert layer.takes_one_call and layer.fused_weights.max_rows() == cpu_gemv.INT8_MAX_ROWS
    assert_fused_matches(layer, layer_class, config, dtype, seqs, first_layer=False, exact_layer=exact)
    assert layer.mlp.down_proj.weight.dtype == torch.uint8
    if paired:  # the C++ layer reads the copies: its output follows them
        got = fused_and_op_by_op(layer, config, dtype, seqs, first_layer=False)[0][0]
        layer.mlp.down_proj.pairs_weight.zero_()
        assert not torch.equal(fused_and_op_by_op(layer, config, dtype, seqs, first_layer=False)[0][0], got)


def generate(model: str, dtype: str, prompts: list[list[int]], steps: int) -> list[list[int]]:
    llm = LLM(model, dtype=dtype, in_process=True, block_size=8, num_scheduler_steps=steps, multi_step_budget_ms=None)
    try:
        runner = llm.client.engine.executor.worker.model_runner
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.uint8
        assert (qkv.pairs_weight is not None) == (dtype == "bfloat16" and cpu_gemv.pairs_cpu())
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert_all_blocks_free(llm)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.shutdown()


@pytest.fixture
def calls(monkeypatch) -> tuple[list, list]:
    """(a 1 per C++ layer call, whether each multi-step call's later steps ran in one C++ call)."""
    layer_calls, one_calls = [], []
    layers, in_one_call = cpu_decoder_layer.decoder_layers, LaterStepCalls._in_one_call
    monkeypatch.setattr(cpu_decoder_layer, "decoder_layers", lambda *a, **kw: layer_calls.append(1) or layers(*a, **kw))
    monkeypatch.setattr(LaterStepCalls, "_in_one_call", lambda *a: one_calls.append(in_one_call(*a)) or one_calls[-1])
    return layer_calls, one_calls


@pytest.mark.parametrize("kind", ["gptq-4bit", *(pytest.param(kind, marks=pytest.mark.slow)
                                                 for kind in ("awq", "ct-w4a16", "ct-w4a16-asymmetric"))])
def test_int4_checkpoints_take_the_fused_path_and_equal_the_reference(kind, calls, monkeypatch):
    """GPTQ (zero points), AWQ, compressed-tensors 4-bit (symmetric, asymmetric): every layer in the C++ layer, the
    later steps of each multi-step call in one C++ call; greedy tokens (float32) equal the dequantized reference's
    (HF) and the op path's. (AWQ and compressed-tensors slow: tests/test_quantized_checkpoints.py's reference
    checks run them through the C++ layer too.)"""
    quantized, reference = checkpoint(kind)
    prompts = random_prompts([3, 40, 17], vocab=1000, seed=5)
    fused = generate(quantized, "float32", prompts, 8)
    assert calls[0] and any(calls[1]), f"the {kind} model never took the C++ layer and its one-call steps"
    assert fused == [hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    monkeypatch.setattr(cpu_decoder_layer, "decode_step", lambda *args: None)
    monkeypatch.setattr(LaterStepCalls, "_in_one_call", lambda *args: False)
    assert generate(quantized, "float32", prompts, 8) == fused


def test_int4_act_order_takes_the_op_path(calls):
    """GPTQ's act-order with a real permutation: the layers decline the C++ layer (its columns are not in groups)."""
    generate(checkpoint("gptq-4bit-act-order")[0], "float32", random_prompts([5], vocab=1000, seed=1), 4)
    assert not calls[0]


def test_int4_bf16_multi_step_equals_one_step_a_call(calls):
    """bf16 (the pairs copies where the CPU has AVX-512 BF16): greedy tokens of multi-step calls, their later steps
    in one C++ call, equal those of one step a call."""
    quantized = checkpoint("gptq-4bit")[0]
    prompts = random_prompts([3, 40, 17], vocab=1000, seed=7)
    multi = generate(quantized, "bfloat16", prompts, 8)
    assert calls[0] and any(calls[1])
    assert generate(quantized, "bfloat16", prompts, 1) == multi
