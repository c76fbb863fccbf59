"""KVCacheManager: THE global block table (block ids per request), grown on demand, shared by prefix hash."""
from __future__ import annotations

from collections.abc import Callable

from core.block_hash import extend_block_hashes
from core.block_pool import BlockPool
from core.kv_offload import OffloadTier
from core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        """num_host_blocks: the host tier's blocks (core/kv_offload.py), 0 for none; only with prefix caching."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tier = OffloadTier(num_host_blocks) if num_host_blocks and enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.tier)
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of each table already findable by hash
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.prefix_cache_host_hits = 0  # of those, tokens found in the host tier and loaded from there

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks if self.pool.num_blocks else 0.0

    def computed_blocks(self, request: Request) -> list[int | bytes]:
        """The longest run of cached blocks that starts the request's tokens: a device block's id, or the hash of a
        block the host tier holds (allocate_slots loads it into a fresh block). At least one token stays to
        compute, since the step that computes a request's last token is the one that samples from it."""
        if not self.enable_prefix_caching or not request.reads_prefix_cache:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int | bytes] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.cached_block(block_hash)
            if block_id is None and (self.tier is None or block_hash not in self.tier):
                break
            blocks.append(block_hash if block_id is None else block_id)
        return blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int | bytes] = ()
                       ) -> list[int] | None:
        """Blocks to add so the request holds its computed tokens (+ computed_blocks, shared from the cache or
        loaded from the host tier, for a request not yet holding any) plus num_new_tokens; None, and nothing
        taken, if too few free."""
        table = self.block_tables.setdefault(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        needed = -(-num_tokens // self.block_size) - len(table) - len(computed_blocks)
        shared = [block for block in computed_blocks if isinstance(block, int)]
        hashes = [block for block in computed_blocks if isinstance(block, bytes)]
        reclaimed = sum(1 for block_id in shared if self.pool.ref_counts[block_id] == 0)
        if needed + reclaimed + len(hashes) > self.pool.num_free_blocks:
            return None
        self.pool.touch(shared)  # before any allocation, which could evict them
        table.extend(self._loaded(computed_blocks, hashes))
        new_blocks = self.pool.allocate(needed) if needed > 0 else []
        table.extend(new_blocks)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, num_tokens)
        return new_blocks

    def _loaded(self, computed_blocks: list[int | bytes], hashes: list[bytes]) -> list[int]:
        """computed_blocks as device blocks: each hash's slot claimed first (so the stores the allocation records
        never reuse it), then a fresh block for it, loaded in this step."""
        if not hashes:
            return list(computed_blocks)
        slots = self.tier.claim(hashes)
        fresh = self.pool.allocate(len(hashes))
        self.tier.load(slots, fresh)
        self.prefix_cache_host_hits += len(hashes) * self.block_size
        loaded = iter(fresh)
        return [next(loaded) if isinstance(block, bytes) else block for block in computed_blocks]

    def cache_loaded(self, request: Request, num_blocks: int, load: Callable[[int, list[int]], bool]) -> int | bool:
        """The request's first num_blocks prompt blocks in the prefix cache: those past the ones it holds already
        loaded by load(first block index, fresh block ids) into free blocks, cached by their hashes and freed (to be
        found like any cached block). The blocks loaded (0: none needed, or too few free), or False if load failed."""
        found = self.computed_blocks(request)
        cached, first = [block for block in found if isinstance(block, int)], len(found)
        count = num_blocks - first
        if count <= 0 or count > self.pool.num_free_blocks - sum(self.pool.ref_counts[b] == 0 for b in cached):
            return 0
        self.pool.touch(cached)  # not evicted by the allocation
        fresh = self.pool.allocate(count)
        loaded = load(first, fresh)
        if loaded:
            for index, block_id in enumerate(fresh, start=first):
                self.pool.cache_block(block_id, request.block_hashes[index])
        self.pool.free([*cached, *reversed(fresh)])
        return count if loaded else False

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's host-tier copies (OffloadTier.take_copies); none without a tier."""
        return self.tier.take_copies() if self.tier is not None else ([], [])

    def record_lookup(self, request: Request, num_cached_tokens: int) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_cached_tokens

    def free(self, request: Request) -> None:
        """Blocks go back last first, so a request's tail (least likely shared) is evicted before its head."""
        self.pool.free(reversed(self.block_tables.pop(request.request_id, [])))
        self.num_cached_blocks.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
        if self.tier is not None:
            self.tier.clear()
        self.num_cached_blocks = {req_id: len(table) for req_id, table in self.block_tables.items()}

    def block_ids(self, request: Request) -> list[int]:
        return self.block_tables.get(request.request_id, [])

    def num_allocated_slots(self) -> int:
        return (self.pool.num_blocks - self.pool.num_free_blocks) * self.block_size

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks this step fills; they are computed before any later step (or a later request
        in this step, whose attention runs after this step's K/V writes) reads them."""
        self._update_hashes(request)
        table, start = self.block_tables[request.request_id], self.num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(start, num_full):
            self.pool.cache_block(table[index], request.block_hashes[index])
        self.num_cached_blocks[request.request_id] = max(start, num_full)

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
                            request.mm_inputs or ())
