"""The host-memory tier of the prefix cache, worker side: a host copy of every KV cache tensor this rank holds (its
layers' K and V, and the draft model's), and the step's copies between them (core/kv_offload.py decides them).

On CUDA the host tensors are pinned and the copies run on a side stream, ordered after the work already queued
(which wrote the blocks being stored) and before the step's forward pass: the host goes on preparing the step while
they run. On the CPU the device cache is host memory too: the copies are memcpys inside the step, before its
forward pass (no threads)."""
from __future__ import annotations

import torch

from workers.layers.attention import Attention


class HostKVTier:
    """Byte copies of whole blocks: a cache of any dtype (fp8 included) is stored as it is held."""

    def __init__(self, caches: list[torch.Tensor], num_slots: int, device: torch.device) -> None:
        """caches: [num_blocks, ...] tensors whose first dimension is the block id."""
        self.caches = [as_bytes(cache) for cache in caches]
        pinned = device.type == "cuda"
        self.host = [torch.empty((num_slots, *cache.shape[1:]), dtype=torch.uint8, pin_memory=pinned)
                     for cache in self.caches]
        self.stream = torch.cuda.Stream(device) if pinned else None

    @classmethod
    def for_layers(cls, layers: list[Attention], num_slots: int, device: torch.device) -> HostKVTier:
        return cls(layer_caches(layers), num_slots, device)

    @property
    def num_slots(self) -> int:
        return self.host[0].shape[0] if self.host else 0

    def apply(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Stores (device block, host slot) first, then loads (host slot, device block): a block evicted and
        reloaded in the same step is stored before it is overwritten."""
        if not stores and not loads:
            return
        if self.stream is None:
            self._copy_cpu(stores, loads)
            return
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for device_cache, host in zip(self.caches, self.host):
                for block, slot, count in _runs(stores):
                    host[slot:slot + count].copy_(device_cache[block:block + count], non_blocking=True)
            for device_cache, host in zip(self.caches, self.host):
                for slot, block, count in _runs(loads):
                    device_cache[block:block + count].copy_(host[slot:slot + count], non_blocking=True)
        current.wait_stream(self.stream)

    def _copy_cpu(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        # Within each list the targets are distinct (host slots of the stores, fresh blocks of the loads).
        if stores:
            blocks, slots = (torch.tensor(column, dtype=torch.int64) for column in zip(*stores))
            for device_cache, host in zip(self.caches, self.host):
                host.index_copy_(0, slots, device_cache.index_select(0, blocks))
        if loads:
            slots, blocks = (torch.tensor(column, dtype=torch.int64) for column in zip(*loads))
            for device_cache, host in zip(self.caches, self.host):
                device_cache.index_copy_(0, blocks, host.index_select(0, slots))


def layer_caches(layers: list[Attention]) -> list[torch.Tensor]:
    """The K and V of these layers (a layer whose K is its V, as MLA's latent cache, counted once)."""
    return list({cache.data_ptr(): cache for layer in layers for cache in layer.kv_cache}.values())


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (the last dimension widened by the element size)."""
    if not cache.is_contiguous():
        raise ValueError(f"a KV cache tensor of shape {tuple(cache.shape)} is not contiguous: the host tier copies "
                         "whole blocks")
    return cache.view(torch.uint8)


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source, target, count): consecutive pairs whose source and target both step by one, as one copy each."""
    runs: list[tuple[int, int, int]] = []
    for source, target in pairs:
        if runs and runs[-1][0] + runs[-1][2] == source and runs[-1][1] + runs[-1][2] == target:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((source, target, 1))
    return runs
