"""The prefix cache's host tier, scheduler side: the block hash in each host slot (LRU), and each step's copies
(workers/kv_offload.py applies them): evicted hashed blocks stored, tier hits loaded into fresh device blocks."""
from __future__ import annotations

from collections import OrderedDict

from ipc import EngineConfig


class OffloadTier:
    """Host slots by block hash, least recently stored or hit first; a hash is held in one slot at most."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"host KV blocks must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.slots: OrderedDict[bytes, int] = OrderedDict()
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        # Slots this step's loads read: never reused for a store of the same step (stores run first).
        self.pinned: set[int] = set()
        self.stores: dict[int, int] = {}  # host slot -> device block; a later store into the slot replaces it
        self.loads: list[tuple[int, int]] = []  # (host slot, device block)
        self.blocks_loaded = 0  # since start

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.slots

    def store(self, block_id: int, block_hash: bytes) -> None:
        """The device evicts `block_id`, holding `block_hash`: keep a copy unless the tier holds that hash already
        (or every slot is read by this step's loads)."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is not None:
            self.slots[block_hash] = slot
            self.stores[slot] = block_id

    def claim(self, hashes: list[bytes]) -> list[int]:
        """The slots holding `hashes` (all held), pinned for this step's loads and made most recently used."""
        slots = []
        for block_hash in hashes:
            self.slots.move_to_end(block_hash)
            slots.append(self.slots[block_hash])
        self.pinned.update(slots)
        return slots

    def load(self, slots: list[int], block_ids: list[int]) -> None:
        """Copy claimed slots into fresh device blocks in this step."""
        self.loads += zip(slots, block_ids)
        self.blocks_loaded += len(block_ids)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's stores (device block, host slot) and loads (host slot, device block); the next step's
        start empty and every slot may be reused."""
        stores = [(block_id, slot) for slot, block_id in self.stores.items()]
        loads, self.stores, self.loads = self.loads, {}, []
        self.pinned.clear()
        return stores, loads

    def clear(self) -> None:
        """Forget every hash (a prefix cache reset, between steps: no copy is pending)."""
        self.slots.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))

    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for block_hash, slot in self.slots.items():
            if slot not in self.pinned:
                del self.slots[block_hash]
                return slot
        return None


def check_offload(config: EngineConfig) -> None:
    """The tier extends the prefix cache: without it nothing would ever be found there (ValueError naming both)."""
    if config.kv_offload_bytes is not None and not config.enable_prefix_caching:
        raise ValueError("kv_offload_bytes keeps evicted prefix-cache blocks in host memory: it needs "
                         "enable_prefix_caching=True (drop --kv-offload-bytes or --no-enable-prefix-caching)")
