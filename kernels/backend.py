"""Which kernels serve a tensor: the Triton ones on CUDA when triton imports (it is optional), else torch."""
from __future__ import annotations

import functools

import torch


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """True when `tensor` is on CUDA and triton imports; the Triton modules are then imported by the caller.

    Callers import them lazily: triton is optional, and it reads TRITON_INTERPRET when a kernel is defined.
    """
    return triton_serves(tensor.device)


def triton_serves(device: torch.device) -> bool:
    """use_triton for tensors on `device`."""
    return device.type == "cuda" and _triton_imports()
