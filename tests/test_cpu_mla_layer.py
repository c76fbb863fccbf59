"""The C++ layer's MLA form (kernels/csrc/mla.h) against DeepSeek's own op-by-op layer, and in the engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, DeepseekV2Config, DeepseekV3Config

from frontend import LLM, SamplingParams
from kernels import cpu_decoder_layer, cpu_extension, cpu_gemv, cpu_greedy_decode
from launch.make_model import make_model
from tests.conftest import tiny_model
from tests.hf_reference import hf_greedy
from tests.test_cpu_decoder_layer import BLOCK_SIZE, make_layer, step_batch, with_pairs
from tests.test_cpu_decoder_layer import test_engine_outputs_equal_the_op_by_op_path as engine_outputs_equal
from workers.models.deepseek_v2 import DeepseekV2DecoderLayer
from workers.models.deepseek_v3 import DeepseekV3DecoderLayer

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
SHAPE = dict(hidden_size=80, num_attention_heads=5, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12,
             v_head_dim=10, intermediate_size=72, max_position_embeddings=512, n_routed_experts=4,
             first_k_dense_replace=1, num_hidden_layers=1)
CASES = {  # five heads (odd); V2 without a q LoRA, V3 with one; YaRN's mscale in the softmax scale
    "v2": (DeepseekV2DecoderLayer, DeepseekV2Config(**SHAPE, q_lora_rank=None, rope_parameters=YARN)),
    "v3 q_lora": (DeepseekV3DecoderLayer, DeepseekV3Config(**SHAPE, q_lora_rank=24, rope_parameters=YARN)),
}

# latent rows of whole 32s (64 + 32): latent_attention's path in mla.h (nine heads: eight at a time, then one)
WIDE = {"v2 latent of 96, nine heads": (DeepseekV2DecoderLayer, DeepseekV2Config(
    **{**SHAPE, "hidden_size": 72, "num_attention_heads": 9, "kv_lora_rank": 64, "qk_rope_head_dim": 32},
    q_lora_rank=None, rope_parameters=YARN)),
    # each head's q rows (32 + 32) two whole tiles of q_b's pairs copy: q_b joins the heads' region
    "v3 q_lora, q rows of whole tiles": (DeepseekV3DecoderLayer, DeepseekV3Config(
        **{**SHAPE, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32}, q_lora_rank=24,
        rope_parameters=YARN))}


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")


def run_both(layer, config, dtype: torch.dtype, seqs, products: str, values: torch.dtype | None = None
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the C++ layer's (out, residual, cache), forward()'s) on one random latent cache [blocks, 1, block, lora +
    rope] bound as key and value, as Attention(shared_kv=True) binds it; inputs rounded to `values` first."""
    tokens = sum(new for _, new in seqs)
    generator = torch.Generator().manual_seed(tokens)
    num_blocks = sum(-(-length // BLOCK_SIZE) for length, _ in seqs) + 3
    values = values or dtype
    width = config.kv_lora_rank + config.qk_rope_head_dim
    cache = torch.randn(num_blocks, 1, BLOCK_SIZE, width, generator=generator).to(values).to(dtype)
    metadata, positions = step_batch(seqs, num_blocks, generator)
    x, residual = (torch.randn(tokens, config.hidden_size, generator=generator).to(values).to(dtype) for _ in "xr")
    attention = layer.fused_attention
    with torch.inference_mode():
        own = cache.clone()
        attention.kv_cache = (own, own)
        expected = [*layer(positions, x, residual, metadata), own]
        own = cache.clone()
        attention.kv_cache = (own, own)
        step = cpu_decoder_layer.decode_step(x, positions, metadata.slot_mapping, metadata.block_tables,
                                             metadata.query_start_loc, layer.fused_weights.max_rows())
        prepared = cpu_decoder_layer.PreparedLayers([layer.fused_weights], [attention.kv_cache], dtype)
        if products == "torch":
            got = cpu_decoder_layer.decoder_layers_with_products(prepared, [layer.fused_products], x, residual, step)
        else:
            assert step.kernel_products
            got = cpu_decoder_layer.decoder_layers(prepared, x, residual, step)
    return [*got, own], expected


SEQS = {"one decode": [(1, 1)], "decodes": [(37, 1), (5, 1), (200, 1)], "short prompt": [(6, 6)],
        "mixed": [(9, 1), (70, 5), (130, 3), (17, 2)]}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", list(SEQS))
@pytest.mark.parametrize("products", ["kernel", "torch", "pairs"])
def test_mla_form_equals_the_layers_own_forward(case, dtype, seqs, products):
    """float32 within a few ulps of forward(); bf16 as close to the float32 layer as forward() is. Decodes run
    absorbed on both paths; chunks run absorbed in the kernel, expanded on the op path. "pairs": every projection
    (q_a and kv_a too) from its paired copy, up to PAIRS_MAX_ROWS."""
    skip_unless_paired(products, dtype)
    layer_class, config = CASES[case]
    layer = with_pairs(make_layer(layer_class, config, dtype, seed=len(seqs)), products == "pairs")
    assert layer.takes_one_call and layer.fused_weights.mla_kv_a is not None
    if products == "pairs":
        weights = layer.fused_weights
        assert weights.mla_kv_a_pairs is not None and (weights.mla_q_a is None) == (weights.mla_q_a_pairs is None)
        assert weights.mla_w_uk_t_pairs is not None and weights.mla_w_uv_pairs is not None
    got, expected = run_both(layer, config, dtype, SEQS[seqs], "torch" if products == "torch" else "kernel")
    # From the same kv_a rows (torch's products) the bf16 latents the kernel writes (norm, rotary, slots) are the op
    # path's bytes; float32 within a few ulps (the norm sums its squares in another order than torch), as from the
    # kernels' products, whose sums run in other orders.
    exact_cache = products == "torch" and dtype == torch.bfloat16
    if exact_cache or dtype == torch.float32:
        torch.testing.assert_close(got[2], expected[2], rtol=0 if exact_cache else 1e-5,
                                   atol=0 if exact_cache else 1e-5)
    if dtype == torch.float32:
        for tensor, reference in zip(got[:2], expected[:2]):
            atol = max(1e-5, 4e-6 * reference.abs().max().item())
            torch.testing.assert_close(tensor, reference, rtol=1e-5, atol=atol)
        return
    assert_as_close_as_the_op_path(layer, layer_class, config, SEQS[seqs], products, got, expected)


def assert_as_close_as_the_op_path(layer, layer_class, config, seqs, products: str, got, expected,
                                   rerouted_share: float = 0.0) -> None:
    """bf16: the kernel's (out, residual) as close to the float32 layer's (from the same bf16 values) as forward()'s,
    on average and at worst (two bf16 steps of slack: sums in other orders round either way); up to rerouted_share
    of the rows, whose experts tie within a rounding, may take other experts and are left out."""
    exact = make_layer(layer_class, config, torch.float32, seed=0)
    exact.load_state_dict({name: value.float() for name, value in layer.state_dict().items()})
    reference = run_both(exact, config, torch.float32, seqs, products, values=torch.bfloat16)[1]
    for tensor, own, exact_value in zip(got[:2], expected[:2], reference[:2]):
        step = 2.0 ** (int(exact_value.abs().max().log2().floor()) - 7)
        rerouted = (tensor.float() - own.float()).abs().amax(-1) > 8 * step
        assert rerouted.float().mean() <= rerouted_share, rerouted.sum()
        kernel_error, op_error = ((t[~rerouted].float() - exact_value[~rerouted]).abs() for t in (tensor, own))
        assert kernel_error.mean() <= 1.1 * op_error.mean() + 1e-5, (kernel_error.mean(), op_error.mean())
        assert kernel_error.max() <= op_error.max() + 2 * step, (kernel_error.max(), op_error.max(), step)


def skip_unless_paired(products: str, dtype: torch.dtype) -> None:
    if products == "pairs" and not (dtype == torch.bfloat16 and cpu_gemv.pairs_cpu()):
        pytest.skip("paired copies: bf16 weights on CPUs with AVX-512 BF16")


@pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="paired copies: bf16 weights on CPUs with AVX-512 BF16")
@pytest.mark.parametrize("name", ["mla_q_a_pairs", "mla_kv_a_pairs", "mla_w_uk_t_pairs", "mla_w_uv_pairs"])
def test_mla_pairs_of_another_shape_are_refused(name):
    layer_class, config = CASES["v3 q_lora"]
    weights = with_pairs(make_layer(layer_class, config, torch.bfloat16, seed=0), True).fused_weights
    wrong = getattr(weights, name)[1:].contiguous()  # a tile of rows, or a head, short
    with pytest.raises(ValueError, match=f"{name} must be kernels.cpu_gemv.pair_weight|pairs must be kernels"):
        type(weights)(**{**weights.__dict__, name: wrong}).check(torch.bfloat16)


def test_mla_form_rejects_a_misfit_latent():
    layer_class, config = CASES["v2"]
    weights = make_layer(layer_class, config, torch.float32, seed=0).fused_weights
    bad = type(weights)(**{**weights.__dict__, "mla_kv_a": weights.mla_kv_a[1:]})
    with pytest.raises(ValueError, match="MLA needs kv_a"):
        bad.check(torch.float32)


def test_grouped_routing_rejects_groups_that_do_not_divide_the_experts():
    layer_class, config = MOE["v2 groups, renormalized"]
    weights = make_layer(layer_class, config, torch.float32, seed=0).fused_weights
    weights.check(torch.float32)
    bad = type(weights)(**{**weights.__dict__, "expert_groups": 4})
    with pytest.raises(ValueError, match="expert_groups that divide the experts"):
        bad.check(torch.float32)


MOE = {  # V2: softmax, greedy or group-limited; V3: sigmoid + correction bias within groups (noaux_tc)
    "v2 greedy": (DeepseekV2DecoderLayer, DeepseekV2Config(
        **{**SHAPE, "first_k_dense_replace": 0}, q_lora_rank=None, rope_parameters=YARN, num_experts_per_tok=2,
        topk_method="greedy", moe_intermediate_size=16, n_shared_experts=2, routed_scaling_factor=1.5)),
    "v2 groups, renormalized": (DeepseekV2DecoderLayer, DeepseekV2Config(
        **{**SHAPE, "first_k_dense_replace": 0, "n_routed_experts": 6}, q_lora_rank=None, rope_parameters=YARN,
        num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=3, topk_group=2, norm_topk_prob=True,
        moe_intermediate_size=16, n_shared_experts=1)),
    "v3 sigmoid, bias, groups": (DeepseekV3DecoderLayer, DeepseekV3Config(
        **{**SHAPE, "first_k_dense_replace": 0, "n_routed_experts": 6}, q_lora_rank=24, rope_parameters=YARN,
        num_experts_per_tok=3, n_group=3, topk_group=2, moe_intermediate_size=16, n_shared_experts=1,
        routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("case", list(MOE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", ["decodes", "mixed"])
@pytest.mark.parametrize("products", ["kernel", "pairs"])
def test_deepseek_experts_equal_the_layers_own_forward(case, dtype, seqs, products):
    """DeepSeek's routing (float32 logits; softmax or sigmoid with V3's correction bias; groups) and ungated shared
    experts: float32 within a few ulps of forward(); bf16 as close to the float32 layer (a token whose experts tie
    within a rounding may take the other). "pairs": the experts', the shared experts' and MLA's products from their
    paired copies (the layer then takes PAIRS_MAX_ROWS)."""
    skip_unless_paired(products, dtype)
    layer_class, config = MOE[case]
    layer = make_layer(layer_class, config, dtype, seed=len(seqs))
    bias = getattr(layer.mlp.gate, "e_score_correction_bias", None)
    if bias is not None:  # spread so that it changes choices (before the layer describes itself)
        bias.data.copy_(0.2 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(1)))
    layer = with_pairs(layer, products == "pairs")
    assert layer.takes_one_call and layer.fused_weights.grouped_router is not None
    got, expected = run_both(layer, config, dtype, SEQS[seqs], "kernel")
    if dtype == torch.float32:
        for tensor, reference in zip(got[:2], expected[:2]):
            atol = max(1e-5, 4e-6 * reference.abs().max().item())
            torch.testing.assert_close(tensor, reference, rtol=1e-5, atol=atol)
        return
    assert_as_close_as_the_op_path(layer, layer_class, config, SEQS[seqs], "kernel", got, expected,
                                   rerouted_share=0.1)


@pytest.mark.parametrize("arch, q_lora_rank, steps", [("deepseek_v2", None, 1), ("deepseek_v3", 24, 8)])
def test_engine_takes_the_c_layer_and_equals_hf(arch, q_lora_rank, steps, monkeypatch):
    """A DeepSeek model (odd heads, YaRN; a dense layer, then experts in groups: V2 group-limited softmax, V3
    sigmoid with its bias): its prompts and decodes run in the C++ layer, a multi-step call's later steps in one
    C++ call, greedy float32 equal to HF."""
    folder = Path(tiny_model(arch)).parent / f"{arch}-tiny-fused-mla"
    routing = {"topk_method": "group_limited_greedy"} if arch == "deepseek_v2" else {}
    model = str(make_model(folder, arch=arch, size="tiny", hidden_size=80, num_attention_heads=5,
                           num_key_value_heads=5, q_lora_rank=q_lora_rank, kv_lora_rank=20, qk_rope_head_dim=8,
                           qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=6, n_group=3, topk_group=2,
                           num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=2,
                           rope_parameters=dict(YARN, original_max_position_embeddings=64), **routing))
    prompts = [list(range(5 + i, 12 + 9 * i)) for i in range(3)]
    calls, whole_steps = [], []
    layers, greedy = cpu_decoder_layer.decoder_layers, cpu_greedy_decode.greedy_decode
    monkeypatch.setattr(cpu_decoder_layer, "decoder_layers", lambda *args: calls.append(1) or layers(*args))
    monkeypatch.setattr(cpu_greedy_decode, "greedy_decode", lambda *args: whole_steps.append(1) or greedy(*args))
    llm = LLM(model, in_process=True, dtype="float32", block_size=16, num_scheduler_steps=steps,
              multi_step_budget_ms=None)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert calls, "the engine never took the C++ layer"
    assert bool(whole_steps) == (steps > 1)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, 16)


@pytest.mark.parametrize(("arch", "products"), [("deepseek_v2", "kernel"), ("deepseek_v3", "torch")])
def test_engine_tokens_and_logprobs_equal_the_op_path(arch, products, monkeypatch):
    """The tiny DeepSeek models through the engine (test_cpu_decoder_layer's check): the same tokens and logprobs
    with the C++ layer, its products the kernels' or torch's, as on the op path."""
    engine_outputs_equal(arch, products, monkeypatch)


@pytest.mark.skipif(not cpu_gemv.pairs_cpu(), reason="paired copies: bf16 weights on CPUs with AVX-512 BF16")
@pytest.mark.parametrize("case", [*CASES, "v3 sigmoid, bias, groups", *WIDE])
@pytest.mark.parametrize("seqs", ["one decode", "mixed"])
def test_mla_products_together_and_heads_split_over_threads_change_no_byte(case, seqs):
    """bf16 from the pairs copies (q or q_a with kv_a in one region; W_UK, attention and W_UV in pieces of rows, a
    batch-1 step's heads split over the threads; the shared expert's products in the routed experts' regions, their
    items split by cost; latent rows of whole 32s): the same bytes on one thread as on two, and as forward() within
    the op path's error."""
    layer_class, config = {**CASES, **MOE, **WIDE}[case]
    layer = with_pairs(make_layer(layer_class, config, torch.bfloat16, seed=5), True)
    weights = layer.fused_weights
    assert case not in MOE or None not in (weights.gate_up_pairs, weights.down_pairs, weights.experts_down_pairs)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(run_both(layer, config, torch.bfloat16, SEQS[seqs], "kernel"))
    finally:
        torch.set_num_threads(threads)
    (one, expected), (two, _) = results
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert_as_close_as_the_op_path(layer, layer_class, config, SEQS[seqs], "kernel", two, expected,
                                   rerouted_share=0.1 if case in MOE else 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_the_thread_count(dtype):
    """The engine changes its thread count between steps (a busy neighbour): a step's bytes must not follow it. MLA's
    pieces of rows are sized without it (a row's products may round differently among other rows: gemv.h's paths by
    row count), so two decodes of the tiny DeepSeek-V3's layer give the same bytes on one thread as on two (in float32
    on AVX2 CPUs they did not)."""
    config = AutoConfig.from_pretrained(tiny_model("deepseek_v3"))
    layer = make_layer(DeepseekV3DecoderLayer, config, dtype, seed=5)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(run_both(layer, config, dtype, [(41, 1), (17, 1)], "kernel")[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))
