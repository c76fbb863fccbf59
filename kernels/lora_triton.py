"""The CUDA twin of kernels/lora_ref.lora_delta: a shrink kernel (x A_s^T for each row's slot s) and an expand kernel
((x A_s^T) B_s^T), one program per block of rows of one slot, reading the slot's weights in place (punica's SGMV
idea: every adapter of the step in one launch). Capture-safe: the rows are grouped by slot on the device and the
grids follow from the shapes (kernels.row_blocks), so one CUDA graph serves any mix of slots."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_ref import Runs
from kernels.row_blocks import group_blocks

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, row_ptr, block_slot_ptr, num_rows, num_slots, K, R, stride_x, stride_as,
                   stride_ar, stride_out, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    if slot >= num_slots:  # a block past the step's last one: the grid is sized for the worst mix of slots
        return
    rows = tl.load(row_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    rows = rows.to(tl.int64)
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
def _expand_kernel(s_ptr, b_ptr, out_ptr, row_ptr, block_slot_ptr, num_rows, num_slots, N, R, stride_s, stride_bs,
                   stride_bn, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    block, block_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    if slot >= num_slots:
        return
    rows = tl.load(row_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    rows = rows.to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, R, BLOCK_R):
        s = tl.load(s_ptr + rows[:, None] * stride_s + (r + rs)[None, :],
                    mask=valid[:, None] & ((r + rs)[None, :] < R), other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn + (r + rs)[:, None],
                    mask=(cols[None, :] < N) & ((r + rs)[:, None] < R), other=0.0)
        acc += tl.dot(s, b.to(tl.float32), input_precision="ieee")
    # Added to the layer's output in place: each row lies in one block, so no other program touches it.
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    out_mask = valid[:, None] & (cols[None, :] < N)
    total = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32) + acc
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, runs: Runs) -> torch.Tensor:
    """Same contract as kernels.lora_ref.lora_delta."""
    slot_of_row = torch.full((x.shape[0],), -1, dtype=torch.int32)
    for slot, start, end in runs:
        slot_of_row[start:end] = slot
    return lora_delta_rows(x, a, b, slot_of_row.to(x.device))


def lora_delta_rows(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_of_row: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [slots, R, K], b [slots, N, R], slot_of_row [T] (on x's device; -1: the base model) → delta [T, N]
    of x's dtype, zero in the rows of no slot."""
    if slot_of_row.shape != (x.shape[0],):
        raise ValueError(f"slot_of_row has shape {tuple(slot_of_row.shape)}; x has {x.shape[0]} rows")
    delta = x.new_zeros(x.shape[0], b.shape[1])
    add_lora(x, a, b, row_blocks(slot_of_row, a.shape[0]), delta)
    return delta


def row_blocks(slot_of_row: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows grouped by slot into the kernels' blocks (kernels.row_blocks.group_blocks): the same for every
    layer of a forward pass, so computed once per pass."""
    return group_blocks(slot_of_row, num_slots, BLOCK_M)


def add_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, blocks: tuple[torch.Tensor, torch.Tensor],
             out: torch.Tensor) -> None:
    """out [T, N] (rows contiguous) += each row's (x A_s^T) B_s^T for the slots of `blocks` (row_blocks of x's rows),
    in place; rows of no slot are left alone. Reads no value on the host."""
    if x.shape[0] == 0:
        return
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    rows, block_slot = blocks
    num_slots, ranks, n = a.shape[0], a.shape[1], b.shape[1]
    shrunk = torch.empty(x.shape[0], ranks, dtype=torch.float32, device=x.device)  # read only where written
    block_r = max(16, triton.next_power_of_2(ranks))  # tl.dot's minimum on older Triton versions' NVIDIA backend
    _shrink_kernel[(block_slot.numel(),)](x, a, shrunk, rows, block_slot, x.shape[0], num_slots, x.shape[1], ranks,
                                          x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0), BLOCK_M=BLOCK_M,
                                          BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    _expand_kernel[(block_slot.numel(), triton.cdiv(n, BLOCK_N))](
        shrunk, b, out, rows, block_slot, x.shape[0], num_slots, n, ranks, shrunk.stride(0), b.stride(0),
        b.stride(1), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=16)
