"""SiLU-gated activation over a merged gate/up projection (torch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim → silu(gate) * up, each rounded to x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
