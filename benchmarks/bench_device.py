"""Where a benchmark's engines run: --device resolved as the engine resolves it, its line for the header, and the
engine arguments that go with it."""
from __future__ import annotations

import torch

from kernels.cpu_features import cpu_has_native_bf16
from workers.device import select_device

# On CUDA an engine gets a fixed KV cache (the CPU default's cap): gpu_memory_utilization would count the engines a
# benchmark holds at once against each other, and give a small model millions of blocks.
CUDA_KV_CACHE_BYTES = 2 << 30


def resolve(name: str) -> str:
    """'auto', 'cpu' or 'cuda' → 'cpu' or 'cuda' ('cuda' without a GPU is the engine's own error)."""
    return select_device(name).type


def describe(device: str) -> str:
    if device == "cuda":
        return f"device: {torch.cuda.get_device_name()}"
    return f"device: cpu; CPU native bf16: {cpu_has_native_bf16()}; torch threads: {torch.get_num_threads()}"


def engine_args(device: str) -> dict:
    return {"device": device, **({"kv_cache_memory": CUDA_KV_CACHE_BYTES} if device == "cuda" else {})}
