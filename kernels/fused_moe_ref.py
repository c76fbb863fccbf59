"""Mixture-of-experts in torch: routing (top-k over softmax or sigmoid scores, optionally group-limited) and
the experts' SwiGLU MLPs over tokens sorted by expert, one pair of matmuls per expert that has tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.matmul import linear


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
                   num_expert_group: int | None = None, topk_group: int | None = None,
                   routed_scaling_factor: float = 1.0, correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, experts] → (weights float32 [tokens, top_k], expert ids int64 [tokens, top_k]).

    Scores are computed in float32; the top_k largest, the lower id first among equal ones. With groups (DeepSeek's
    group-limited routing) only experts of the `topk_group` groups with the highest best score compete;
    `renormalize` makes each token's weights sum to 1 before `routed_scaling_factor` multiplies them. With a
    `correction_bias` (DeepSeek-V3's noaux_tc) experts are chosen by score + bias, a group ranked by the sum of its
    two best such scores, and weighted by their unbiased score."""
    logits = router_logits.float()
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"MoE scoring function {scoring!r} is not supported (supported: 'softmax', 'sigmoid')")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        choice = _keep_top_groups(choice, num_expert_group, topk_group or num_expert_group,
                                  best=1 if correction_bias is None else 2)
    # Equal scores (frequent among bf16 router logits) go to the lower expert id, as the C++ layer (experts.h)
    # chooses: torch.topk breaks such ties in an order of its own.
    weights, ids = (t[..., :top_k] for t in torch.sort(choice, dim=-1, descending=True, stable=True))
    if correction_bias is not None:
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def _keep_top_groups(scores: torch.Tensor, num_groups: int, keep: int, best: int = 1) -> torch.Tensor:
    """Zero the scores of every expert outside each token's `keep` groups ranked by the sum of their `best` highest
    scores."""
    num_tokens, num_experts = scores.shape
    group_scores = scores.view(num_tokens, num_groups, -1).topk(best, dim=-1).values.sum(dim=-1)
    top_groups = torch.topk(group_scores, keep, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
    return scores.masked_fill(expert_mask.reshape(num_tokens, -1) == 0, 0.0)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for the experts this rank holds.

    x [tokens, hidden]; gate_up [local experts, 2 * inter, hidden] (gate rows first); down [local experts,
    hidden, inter]; local expert e is global expert first_expert + e. Choices of other experts add nothing
    (expert parallel: their rank adds them). The (token, choice) pairs are sorted by expert once, so each
    expert multiplies one contiguous block of rows; results are weighted and summed in float32."""
    num_tokens, top_k = topk_ids.shape
    num_local = gate_up.shape[0]
    local_ids = topk_ids.flatten() - first_expert
    local_ids = torch.where((local_ids >= 0) & (local_ids < num_local), local_ids, num_local)
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=num_local + 1).tolist()
    num_rows = num_tokens * top_k - counts[num_local]
    order = order[:num_rows]
    token_of_row = order // top_k
    rows = x[token_of_row]
    outputs, start = [], 0
    for expert, count in enumerate(counts[:num_local]):
        if count:
            gate, up = linear(rows[start:start + count], gate_up[expert]).chunk(2, dim=-1)
            outputs.append(linear(F.silu(gate) * up, down[expert]))
        start += count
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    if outputs:
        weighted = torch.cat(outputs).float() * topk_weights.flatten()[order].unsqueeze(1)
        out.index_add_(0, token_of_row, weighted)
    return out.to(x.dtype)


def moe_per_expert_loop(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_experts as HF transformers computes it: for each expert, find its tokens with a mask, gather them,
    run its MLP with plain F.linear and add the weighted result. The reference the twin is tested and
    benchmarked against."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        token_idx, choice = torch.where(topk_ids == expert)
        if token_idx.numel() == 0:
            continue
        gate, up = F.linear(x[token_idx], gate_up[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, token_idx, expert_out.float() * topk_weights[token_idx, choice, None])
    return out.to(x.dtype)
