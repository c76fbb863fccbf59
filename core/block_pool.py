"""BlockPool: every KV block with its ref count, and the free-block queue (LRU order, O(1) take/return)."""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Oldest freed first: blocks freed long ago are reused before recently freed ones (future prefix hits).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks with {len(self.free_queue)} free")
        block_ids = [self.free_queue.popitem(last=False)[0] for _ in range(count)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed while not in use")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
