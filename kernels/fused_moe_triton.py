"""The experts of a MoE layer as two grouped GEMMs (Triton twin of fused_moe_ref.fused_experts).

The (token, choice) pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M, so every
row block belongs to one expert: a program multiplies one block of rows by one expert's weight tile. The first
GEMM gathers token rows and writes gate_up rows per pair; the second reads those rows, scales each by its routing
weight and writes per pair; the top-k pairs of each token are then summed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _expert_matmul_kernel(a_ptr, w_ptr, c_ptr, pair_ptr, expert_ptr, weight_ptr, num_pairs, N, K, top_k,
                          stride_a, stride_we, stride_wn, stride_c,
                          GATHER_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair] = A[row of pair] @ W[expert]^T for one block of BLOCK_M pairs (padding pairs are >= num_pairs)."""
    block_m, block_n = tl.program_id(0), tl.program_id(1)
    pairs = tl.load(pair_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // top_k if GATHER_TOKENS else pairs).to(tl.int64)
    expert = tl.load(expert_ptr + block_m).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * stride_a + (k + ks)[None, :],
                    mask=valid[:, None] & ((k + ks)[None, :] < K), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + (k + ks)[:, None],
                    mask=(cols[None, :] < N) & ((k + ks)[:, None] < K), other=0.0)
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if MUL_WEIGHT:
        # As the twin: the expert's output rounded to the activations' dtype, then weighted in float32.
        weight = tl.load(weight_ptr + pairs, mask=valid, other=0.0)
        acc = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_c + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


def align_pairs(topk_ids: torch.Tensor, first_expert: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by local expert, each expert's run padded to BLOCK_M with the id num_pairs; the local
    expert of each block). Pairs routed to other ranks' experts are left out."""
    num_pairs = topk_ids.numel()
    local = topk_ids.flatten() - first_expert
    mine = (local >= 0) & (local < num_local)
    order = torch.argsort(torch.where(mine, local, num_local), stable=True)[:int(mine.sum())]
    counts = torch.bincount(local[mine], minlength=num_local)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    starts = torch.cumsum(blocks * BLOCK_M, 0) - blocks * BLOCK_M  # each expert's first padded slot
    rank_in_expert = torch.arange(order.numel(), device=order.device) - (torch.cumsum(counts, 0) - counts)[local[order]]
    pairs = torch.full((int(blocks.sum()) * BLOCK_M,), num_pairs, dtype=torch.int32, device=topk_ids.device)
    pairs[starts[local[order]] + rank_in_expert] = order.to(torch.int32)
    experts = torch.repeat_interleave(torch.arange(num_local, device=topk_ids.device, dtype=torch.int32), blocks)
    return pairs, experts


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """Same contract as fused_moe_ref.fused_experts."""
    num_tokens, top_k = topk_ids.shape
    num_local, two_inter, hidden = gate_up.shape
    pairs, experts = align_pairs(topk_ids, first_expert, num_local)
    num_pairs = num_tokens * top_k
    h = torch.zeros(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    if experts.numel():
        x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
        weights = topk_weights.flatten().float().contiguous()
        _launch(x, gate_up, h, pairs, experts, weights, num_pairs, top_k, gather_tokens=True)
        gate, up = h.chunk(2, dim=-1)
        activated = (F.silu(gate) * up).contiguous()
        _launch(activated, down, out, pairs, experts, weights, num_pairs, top_k, gather_tokens=False)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _launch(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, pairs: torch.Tensor, experts: torch.Tensor,
            weights: torch.Tensor, num_pairs: int, top_k: int, gather_tokens: bool) -> None:
    n, k = w.shape[1], w.shape[2]
    grid = (experts.numel(), triton.cdiv(n, BLOCK_N))
    _expert_matmul_kernel[grid](a, w, c, pairs, experts, weights, num_pairs, n, k, top_k, a.stride(0), w.stride(0),
                                w.stride(1), c.stride(0), GATHER_TOKENS=gather_tokens, MUL_WEIGHT=not gather_tokens,
                                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
