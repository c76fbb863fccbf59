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

from kernels.row_blocks import group_blocks

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _expert_matmul_kernel(a_ptr, w_ptr, c_ptr, pair_ptr, expert_ptr, weight_ptr, num_pairs, num_experts, N, K, top_k,
                          stride_a, stride_we, stride_wn, stride_c,
                          GATHER_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair] = A[row of pair] @ W[expert]^T for one block of BLOCK_M pairs (padding pairs are >= num_pairs)."""
    block_m, block_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + block_m).to(tl.int64)
    if expert >= num_experts:  # a block past the step's last one: the grid is sized for the worst routing
        return
    pairs = tl.load(pair_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // top_k if GATHER_TOKENS else pairs).to(tl.int64)
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


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """Same contract as fused_moe_ref.fused_experts. Capture-safe: the pairs are sorted on the device and both
    launches' grids follow from the shapes (kernels.row_blocks), so one CUDA graph serves every routing."""
    num_tokens, top_k = topk_ids.shape
    num_local, two_inter, hidden = gate_up.shape
    num_pairs = num_tokens * top_k
    h = torch.zeros(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    if num_pairs:
        pairs, experts = group_blocks(topk_ids.flatten() - first_expert, num_local, BLOCK_M)
        x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
        weights = topk_weights.flatten().float().contiguous()
        _launch(x, gate_up, h, pairs, experts, weights, top_k, gather_tokens=True)
        gate, up = h.chunk(2, dim=-1)
        activated = (F.silu(gate) * up).contiguous()
        _launch(activated, down, out, pairs, experts, weights, top_k, gather_tokens=False)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _launch(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, pairs: torch.Tensor, experts: torch.Tensor,
            weights: torch.Tensor, top_k: int, gather_tokens: bool) -> None:
    n, k = w.shape[1], w.shape[2]
    grid = (experts.numel(), triton.cdiv(n, BLOCK_N))
    _expert_matmul_kernel[grid](a, w, c, pairs, experts, weights, weights.numel(), w.shape[0], n, k, top_k,
                                a.stride(0), w.stride(0), w.stride(1), c.stride(0), GATHER_TOKENS=gather_tokens,
                                MUL_WEIGHT=not gather_tokens, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
