"""The CUDA twin of kernels/lora_ref.lora_delta: a shrink kernel (x A_s^T for each run's rows) and an expand kernel
((x A_s^T) B_s^T), one program per block of a run's rows, reading the run's slot weights in place (punica's SGMV
idea: every adapter of the step in one launch)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_ref import Runs

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, run_slot_ptr, run_start_ptr, run_len_ptr, K, R, stride_x, stride_as,
                   stride_ar, stride_out, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    run, block = tl.program_id(0), tl.program_id(1)
    slot = tl.load(run_slot_ptr + run).to(tl.int64)
    start, length = tl.load(run_start_ptr + run), tl.load(run_len_ptr + run)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < length
    rows = (start + rows).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * stride_x + (k + ks)[None, :],
                    mask=valid[:, None] & ((k + ks)[None, :] < K), other=0.0)
        a = tl.load(a_ptr + slot * stride_as + ranks[None, :] * stride_ar + (k + ks)[:, None],
                    mask=(ranks[None, :] < R) & ((k + ks)[:, None] < K), other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_out + ranks[None, :], acc, mask=valid[:, None] & (ranks[None, :] < R))


@triton.jit
def _expand_kernel(s_ptr, b_ptr, out_ptr, run_slot_ptr, run_start_ptr, run_len_ptr, N, R, stride_s, stride_bs,
                   stride_bn, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    run, block, block_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(run_slot_ptr + run).to(tl.int64)
    start, length = tl.load(run_start_ptr + run), tl.load(run_len_ptr + run)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < length
    rows = (start + rows).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, R, BLOCK_R):
        s = tl.load(s_ptr + rows[:, None] * stride_s + (r + rs)[None, :],
                    mask=valid[:, None] & ((r + rs)[None, :] < R), other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn + (r + rs)[:, None],
                    mask=(cols[None, :] < N) & ((r + rs)[:, None] < R), other=0.0)
        acc += tl.dot(s, b.to(tl.float32), input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, runs: Runs) -> torch.Tensor:
    """Same contract as kernels.lora_ref.lora_delta."""
    delta = x.new_zeros(x.shape[0], b.shape[1])
    if not runs:
        return delta
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    ranks, n = a.shape[1], b.shape[1]
    slots, starts, lengths = (torch.tensor(column, dtype=torch.int32, device=x.device)
                              for column in zip(*((slot, start, end - start) for slot, start, end in runs)))
    blocks = triton.cdiv(max(end - start for _, start, end in runs), BLOCK_M)
    shrunk = torch.zeros(x.shape[0], ranks, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(ranks))  # tl.dot's minimum on older Triton versions' NVIDIA backend
    _shrink_kernel[(len(runs), blocks)](x, a, shrunk, slots, starts, lengths, x.shape[1], ranks, x.stride(0),
                                        a.stride(0), a.stride(1), shrunk.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=block_r,
                                        BLOCK_K=BLOCK_K)
    _expand_kernel[(len(runs), blocks, triton.cdiv(n, BLOCK_N))](
        shrunk, b, delta, slots, starts, lengths, n, ranks, shrunk.stride(0), b.stride(0), b.stride(1),
        delta.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=16)
    return delta
