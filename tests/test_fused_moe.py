"""The fused-MoE twin (tokens sorted by expert, one matmul pair per expert) equals the per-expert loop HF
transformers runs; routing picks what the models' reference formulas pick."""
from __future__ import annotations

import pytest
import torch

from kernels.fused_moe_ref import fused_experts, moe_per_expert_loop, select_experts


def moe_inputs(tokens: int, experts: int, top_k: int, hidden: int = 48, inter: int = 40, seed: int = 0,
               dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, gate_up, down, weights, ids


# Single tokens and few rows take the GEMV kernel; 256 tokens the GEMM; 3 of 5 experts leaves some without tokens.
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (5, 5, 3), (16, 8, 2), (256, 8, 2), (64, 16, 6)])
def test_twin_equals_per_expert_loop(tokens, experts, top_k):
    x, gate_up, down, weights, ids = moe_inputs(tokens, experts, top_k)
    expected = moe_per_expert_loop(x, gate_up, down, weights, ids)
    got = fused_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_bf16_twin_is_as_close_to_float32_as_the_loop():
    x, gate_up, down, weights, ids = moe_inputs(64, 8, 2, dtype=torch.bfloat16)
    exact = moe_per_expert_loop(x.float(), gate_up.float(), down.float(), weights, ids)
    loop_error = (moe_per_expert_loop(x, gate_up, down, weights, ids).float() - exact).abs().max()
    twin_error = (fused_experts(x, gate_up, down, weights, ids).float() - exact).abs().max()
    assert twin_error <= loop_error * 1.5


def test_expert_parallel_shares_sum_to_the_whole():
    """Each rank's share of the experts (first_expert offsets) adds the choices of its experts only."""
    x, gate_up, down, weights, ids = moe_inputs(33, 6, 2)
    whole = fused_experts(x, gate_up, down, weights, ids)
    shares = [fused_experts(x, gate_up[start:end], down[start:end], weights, ids, first_expert=start)
              for start, end in [(0, 3), (3, 5), (5, 6)]]
    torch.testing.assert_close(sum(shares), whole, rtol=0, atol=1e-6)


def test_no_tokens_gives_an_empty_output():
    x, gate_up, down, weights, ids = moe_inputs(0, 4, 2)
    assert fused_experts(x, gate_up, down, weights, ids).shape == (0, 48)


def test_softmax_routing_renormalised_or_not():
    logits = torch.randn(10, 8)
    probs = logits.softmax(-1)
    top, ids = probs.topk(2, dim=-1)
    weights, got_ids = select_experts(logits, 2, renormalize=False)
    assert torch.equal(got_ids, ids) and torch.allclose(weights, top)
    weights, _ = select_experts(logits, 2, renormalize=True)
    assert torch.allclose(weights, top / top.sum(-1, keepdim=True))


def test_group_limited_routing_picks_only_from_the_best_groups():
    """DeepSeek-V2: 8 experts in 4 groups, the 2 groups with the highest best score compete; scaled after."""
    logits = torch.randn(50, 8)
    weights, ids = select_experts(logits, 3, renormalize=False, num_expert_group=4, topk_group=2,
                                  routed_scaling_factor=2.5)
    scores = logits.softmax(-1)
    best_groups = scores.view(50, 4, 2).max(-1).values.topk(2, dim=-1).indices
    for token in range(50):
        allowed = {2 * g + i for g in best_groups[token].tolist() for i in range(2)}
        assert set(ids[token].tolist()) <= allowed
        ranked = sorted(allowed, key=lambda e: -scores[token, e])[:3]
        assert sorted(ids[token].tolist()) == sorted(ranked)
        torch.testing.assert_close(weights[token], 2.5 * scores[token, ids[token]])


def test_unknown_scoring_is_refused():
    with pytest.raises(ValueError, match="scoring function 'tanh'"):
        select_experts(torch.randn(2, 4), 1, True, scoring="tanh")


def test_noaux_tc_routing_equals_deepseek_v3s():
    """DeepSeek-V3: sigmoid scores, experts chosen by score + correction bias in the groups whose two best such
    scores sum highest, weighted by the unbiased score (normalised, scaled): transformers' router's choice."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=16, n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3,
                              norm_topk_prob=True, routed_scaling_factor=2.5)
    generator = torch.Generator().manual_seed(0)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(12, generator=generator) * 0.3)
    hidden = torch.randn(50, 16, generator=generator)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(logits, 3, True, "sigmoid", 4, 2, 2.5, router.e_score_correction_bias)
    for token in range(50):
        ours = dict(zip(ids[token].tolist(), weights[token].tolist()))
        theirs = dict(zip(hf_ids[token].tolist(), hf_weights[token].tolist()))
        assert ours.keys() == theirs.keys()
        for expert, weight in ours.items():
            assert weight == pytest.approx(theirs[expert], rel=1e-5)
