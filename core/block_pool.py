"""BlockPool: every KV block with its ref count and content hash, and the LRU free-block queue."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from core.kv_offload import OffloadTier


class BlockPool:
    """A free block keeps its hash (and so its cached content) until it is taken for new content; then, with a host
    tier, its content is stored there (if not held already) in the step that takes it, before anything overwrites it."""

    def __init__(self, num_blocks: int, tier: OffloadTier | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Oldest freed first: blocks freed long ago are evicted before recently freed ones (future prefix hits).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}
        self.tier = tier

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[int]:
        """Take the `count` least recently freed blocks, evicting whatever they cached."""
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks with {len(self.free_queue)} free")
        block_ids = [self.free_queue.popitem(last=False)[0] for _ in range(count)]
        for block_id in block_ids:
            self._uncache(block_id)
            self.ref_counts[block_id] = 1
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Share cached blocks with one more request (a free one leaves the free queue)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed while not in use")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Make a full, computed block findable by its hash (the first block with that content wins)."""
        if block_hash not in self.cached_blocks:
            self.cached_blocks[block_hash] = block_id
            self.block_hashes[block_id] = block_hash

    def cached_block(self, block_hash: bytes) -> int | None:
        return self.cached_blocks.get(block_hash)

    def reset_cache(self) -> None:
        """Forget every hash: no block is found by content any more (blocks in use keep their data)."""
        self.cached_blocks.clear()
        self.block_hashes = [None] * self.num_blocks

    def _uncache(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached_blocks[block_hash]
            self.block_hashes[block_id] = None
            if self.tier is not None:
                self.tier.store(block_id, block_hash)
