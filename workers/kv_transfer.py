"""Disaggregated prefill's transfer region, worker side: a file in /dev/shm both engines of the group map (or, for
ZmqConnector, each engine's private memory: the prefill engine's slots are served over ZMQ into the decode engine's),
whose slots each hold one KV block (every layer's K and V, as bytes) under a header of (nonce, block index, token
checksum).

A writer clears a slot's nonce, copies the block, then writes the header with the nonce last; a reader checks the
header, copies, and checks the nonce again: a slot rewritten meanwhile fails the check (x86 keeps stores in order,
which shared_memory_supported() requires). A reader releases a slot by clearing its nonce."""
from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from ipc.kv_transfer import KVTransferConfig
from workers.kv_offload import as_bytes, layer_caches
from workers.layers.attention import Attention
from workers.shm_region import SHM_DIR, header_bytes, shared_memory_supported

_HEADER_WORDS = 4  # nonce, block index, checksum, spare
_NONCE, _INDEX, _CHECKSUM = 0, 1, 2


class TransferRegion:
    def __init__(self, name: str | None, caches: list[torch.Tensor], buffer_bytes: int, device: torch.device) -> None:
        """Map /dev/shm/<name>, made here if the other engine has not made it yet (both size it alike); name None:
        this process's own memory."""
        if name is not None and not shared_memory_supported():
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
        self.region = _private_map(offsets[-1]) if name is None else _shared_map(name, offsets[-1])
        self.headers = np.frombuffer(self.region, dtype=np.uint64, count=_HEADER_WORDS * self.num_slots
                                     ).reshape(self.num_slots, _HEADER_WORDS)
        self.caches = [as_bytes(cache) for cache in caches]
        self.slots = [torch.frombuffer(self.region, dtype=torch.uint8, count=size * self.num_slots, offset=offset)
                      .view(self.num_slots, *cache.shape[1:])
                      for size, offset, cache in zip(block_bytes, offsets, self.caches)]
        self.device = device

    @classmethod
    def for_layers(cls, transfer: KVTransferConfig, layers: list[Attention], device: torch.device) -> TransferRegion:
        name = transfer.region if transfer.kv_connector == "SharedMemoryConnector" else None
        return cls(name, layer_caches(layers), transfer.kv_buffer_bytes, device)

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

    def snapshot(self, slots: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """The slots' headers (nonce, block index, checksum) and bytes (one array per cache), copied while another
        thread may rewrite them: a slot rewritten meanwhile gets nonce 0, as read() would see it."""
        headers = self.headers[slots, :3].copy()
        sources = torch.tensor(slots, dtype=torch.int64)
        frames = [region.index_select(0, sources).numpy() for region in self.slots]
        headers[self.headers[slots, _NONCE] != headers[:, _NONCE], _NONCE] = 0
        return headers, frames

    def fill(self, slots: list[int], headers: list[list[int]], frames: list[memoryview]) -> bool:
        """Another region's snapshot() into these slots (headers as given, for read() to check); False, with the
        slots released, where the frames do not have the sizes of len(slots) slots."""
        self.headers[slots, _NONCE] = 0
        if len(headers) != len(slots) or any(len(words) != 3 for words in headers) or len(frames) != len(self.slots) \
                or any(frame.nbytes != len(slots) * region[0].numel() for frame, region in zip(frames, self.slots)):
            return False
        for frame, region in zip(frames, self.slots):
            region.numpy()[slots] = np.frombuffer(frame, dtype=np.uint8).reshape(len(slots), *region.shape[1:])
        self.headers[slots, _INDEX] = [words[_INDEX] for words in headers]
        self.headers[slots, _CHECKSUM] = [words[_CHECKSUM] for words in headers]
        self.headers[slots, _NONCE] = [words[_NONCE] for words in headers]
        return True

    def _indices(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.device)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _shared_map(name: str, size: int) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # pages reserved now: a full /dev/shm fails here, not as SIGBUS
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _private_map(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
