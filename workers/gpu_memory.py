"""The KV cache's share of a GPU: what gpu_memory_utilization leaves after a profiled step's peak memory."""
from __future__ import annotations

from collections.abc import Callable
import gc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes on one GPU, measured around the step with the largest activations."""

    total: int  # the device's memory
    free: int  # free on the device after the step (torch's cache emptied)
    torch_peak: int  # most torch held during the step: weights and activations
    torch_in_use: int  # what torch still holds after it: the weights

    @property
    def non_torch(self) -> int:
        """In use but not by torch's allocator: the CUDA context, NCCL and cuBLAS buffers, other processes."""
        return max(0, self.total - self.free - self.torch_in_use)


def kv_cache_budget(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes for the KV cache: total * utilization, less the step's peak and the memory torch does not manage
    (vLLM's rule). Negative when the weights and activations alone exceed the share."""
    return int(profile.total * gpu_memory_utilization) - profile.torch_peak - profile.non_torch


def profile_memory(run_step: Callable[[], None], device: torch.device) -> MemoryProfile:
    """Run the step once and measure it."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(total=total, free=free, torch_peak=peak, torch_in_use=torch.cuda.memory_allocated(device))


def release_device_memory(device: torch.device) -> None:
    """Hand what torch caches on `device` back to the driver, once the objects holding it are dropped (some, like
    the model runner, sit in reference cycles only a collection frees)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
