"""Disaggregated prefill's shared region, worker side: a file in /dev/shm both engines of the group map, whose slots
each hold one KV block (every layer's K and V, as bytes) under a header of (nonce, block index, token checksum).

A writer clears a slot's nonce, copies the block, then writes the header with the nonce last; a reader checks the
header, copies, and checks the nonce again: a slot rewritten meanwhile fails the check (x86 keeps stores in order,
which shared_memory_supported() requires). A reader releases a slot by clearing its nonce."""
from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from workers.kv_offload import as_bytes, layer_caches
from workers.layers.attention import Attention
from workers.shm_region import SHM_DIR, header_bytes, shared_memory_supported

_HEADER_WORDS = 4  # nonce, block index, checksum, spare
_NONCE, _INDEX, _CHECKSUM = 0, 1, 2


class TransferRegion:
    def __init__(self, name: str, caches: list[torch.Tensor], buffer_bytes: int, device: torch.device) -> None:
        """Map /dev/shm/<name>, made here if the other engine has not made it yet (both size it alike)."""
        if not shared_memory_supported():
            raise ValueError("kv_transfer_config's SharedMemoryConnector needs an x86 CPU (its stores are seen in "
                             "order, which the slots' headers rely on)")
        block_bytes = [cache[0].numel() * cache.element_size() for cache in caches]
        self.num_slots = buffer_bytes // (sum(block_bytes) + 8 * _HEADER_WORDS)
        if self.num_slots < 1:
            raise ValueError(f"kv_transfer_config.kv_buffer_bytes={buffer_bytes} holds no KV block (one takes "
                             f"{sum(block_bytes) + 8 * _HEADER_WORDS} bytes with its header)")
        offsets = [header_bytes(8 * _HEADER_WORDS * self.num_slots)]
        for size in block_bytes:
            offsets.append(offsets[-1] + header_bytes(size * self.num_slots))
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, offsets[-1])  # pages reserved now: a full /dev/shm fails here, not as SIGBUS
            self.region = mmap.mmap(fd, offsets[-1])
        finally:
            os.close(fd)
        self.headers = np.frombuffer(self.region, dtype=np.uint64, count=_HEADER_WORDS * self.num_slots
                                     ).reshape(self.num_slots, _HEADER_WORDS)
        self.caches = [as_bytes(cache) for cache in caches]
        self.slots = [torch.frombuffer(self.region, dtype=torch.uint8, count=size * self.num_slots, offset=offset)
                      .view(self.num_slots, *cache.shape[1:])
                      for size, offset, cache in zip(block_bytes, offsets, self.caches)]
        self.device = device

    @classmethod
    def for_layers(cls, name: str, layers: list[Attention], buffer_bytes: int, device: torch.device) -> TransferRegion:
        return cls(name, layer_caches(layers), buffer_bytes, device)

    def released(self, slot: int) -> bool:
        """Whether no transfer holds the slot (never written, read by the decode engine, or being rewritten)."""
        return int(self.headers[slot, _NONCE]) == 0

    def write(self, block_ids: list[int], slots: list[int], nonce: int, checksum: int) -> None:
        """Block block_ids[i] into slots[i], headed (nonce, i, checksum)."""
        self.headers[slots, _NONCE] = 0
        blocks, targets = self._indices(block_ids), torch.tensor(slots, dtype=torch.int64)
        for cache, region in zip(self.caches, self.slots):
            region.index_copy_(0, targets, cache.index_select(0, blocks).cpu())
        for index, slot in enumerate(slots):
            self.headers[slot, _INDEX] = index
            self.headers[slot, _CHECKSUM] = checksum
            self.headers[slot, _NONCE] = nonce

    def read(self, slots: list[int], block_ids: list[int], nonce: int, checksum: int, first: int = 0) -> bool:
        """slots[i] (the transfer's block first + i) into block_ids[i] where every header reads (nonce, first + i,
        checksum) before and nonce after the copy; False (the blocks' content then undefined) otherwise. The slots
        read are released."""
        if any(not 0 <= slot < self.num_slots for slot in slots):
            return False
        expected = [(nonce, first + index, checksum) for index in range(len(slots))]
        if [tuple(int(word) for word in self.headers[slot, :3]) for slot in slots] != expected:
            return False
        blocks, sources = self._indices(block_ids), torch.tensor(slots, dtype=torch.int64)
        for cache, region in zip(self.caches, self.slots):
            cache.index_copy_(0, blocks, region.index_select(0, sources).to(self.device))
        self._synchronize()  # the copy has read the slots before their nonce is checked again
        intact = all(int(self.headers[slot, _NONCE]) == nonce for slot in slots)
        self.release(slots, nonce)
        return intact

    def release(self, slots: list[int], nonce: int) -> None:
        """Free those of the slots that still hold this transfer for the prefill engine's next ones."""
        for slot in slots:
            if 0 <= slot < self.num_slots and int(self.headers[slot, _NONCE]) == nonce:
                self.headers[slot, _NONCE] = 0

    def _indices(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.device)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
