"""The torch device a rank runs on, from EngineConfig.device."""
from __future__ import annotations

import torch


def select_device(name: str) -> torch.device:
    """'auto' → the first visible GPU when torch sees one, else the CPU; 'cuda' without a usable GPU is a
    ValueError here rather than a failure deep inside torch. A GPU becomes this process's current device
    (under Ray, CUDA_VISIBLE_DEVICES leaves each rank its own GPU as cuda:0)."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={name!r}, but torch sees no usable GPU here (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'none'}); use device='cpu' or 'auto'")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device
