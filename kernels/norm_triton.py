"""RMSNorm with an optional fused residual add in one pass over each row (Triton twin of norm_ref)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden_size, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row; the roundings to the input dtype are those of the torch twin."""
    row = tl.program_id(0).to(tl.int64) * hidden_size
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row + cols, x, mask=mask)
    h = x.to(tl.float32)
    h = (h * tl.rsqrt(tl.sum(h * h, axis=0) / hidden_size + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row + cols, (weight.to(tl.float32) * h.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as norm_ref.rms_norm."""
    hidden_size = x.shape[-1]
    rows = x.reshape(-1, hidden_size).contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(rows) if residual is not None else None
    residual_rows = residual.reshape(-1, hidden_size).contiguous() if residual is not None else None
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, residual_rows, weight, out, residual_out, hidden_size, eps,
                                           HAS_RESIDUAL=residual is not None,
                                           BLOCK=triton.next_power_of_2(hidden_size))
    return out if residual is None else (out, residual_out.view(x.shape))
