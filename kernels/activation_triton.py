"""SiLU-gated activation in one pass over [gate | up] (Triton twin of activation_ref): one kernel where torch
launches two and writes silu(gate) to memory in between."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, BLOCK: tl.constexpr):
    """Program (row, chunk); rounds silu(gate) to the input dtype before the product, as the torch twin does."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * 2 * width + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * width + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * width + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as activation_ref.silu_and_mul."""
    width = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * width).contiguous()
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    if rows.shape[0] and width:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, _BLOCK))](rows, out, width, BLOCK=_BLOCK)
    return out
