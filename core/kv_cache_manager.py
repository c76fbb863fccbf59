"""KVCacheManager: THE global block table (block ids per request), grown on demand from the BlockPool."""
from __future__ import annotations

from core.block_pool import BlockPool
from core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Blocks to add so the request can hold its computed tokens plus num_new_tokens; None if too few free."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        if needed > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.allocate(needed) if needed > 0 else []
        table.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        self.pool.free(self.block_tables.pop(request.request_id, []))

    def block_ids(self, request: Request) -> list[int]:
        return self.block_tables.get(request.request_id, [])

    def num_allocated_slots(self) -> int:
        return (self.pool.num_blocks - self.pool.num_free_blocks) * self.block_size
