"""Tensor-parallel collectives for CPU ranks on one host: all-reduce and gather through shared memory, not gloo."""
from __future__ import annotations

import logging
import mmap
import os

import numpy as np
import torch
import torch.distributed as dist

from kernels.cpu_decoder_layer import ShmGroup
from workers import shm_region
from workers.polling import poll, poll_budget_ns
from workers.shm_region import SHM_DIR, TOKEN_BYTES, ShmPaths

SLOT_BYTES = 4 << 20  # per rank and buffer; larger tensors go through in chunks of this size
# Waking a rank blocked on its FIFO takes 50-100 us on a shared VM, more than the ranks' usual skew at a
# collective: a waiter polls the peers' round counters this long before it blocks.
SPIN_US = int(os.environ.get("PAGEDSERVE_SHM_SPIN_US", "200"))
_MAX_CACHED_VIEWS = 4096  # (buffer, size, dtype) keys: one per batch shape seen, so a bound only for safety

logger = logging.getLogger(__name__)


class ShmCommunicator:
    """Round k: each rank copies its tensor (or the chunk of it) into slots[k % 2][rank], sets its round counter
    to k + 1 and writes one byte to every peer's FIFO; it then waits until every peer's counter reaches k + 1
    and reads the peers' slots. Two buffers make reuse safe: a peer that has published round k + 1 has
    finished reading round k. A waiter polls the counters for up to SPIN_US µs (yielding the CPU each time),
    then blocks reading its FIFO, whose bytes only wake it up. Ranks that outnumber the CPUs never poll.
    Peers' FIFOs are written without blocking: a full FIFO already holds wake-ups enough."""

    def __init__(self, region: mmap.mmap, fifos: list[int], tp_rank: int, slot_bytes: int) -> None:
        self.region, self.fifos, self.tp_rank, self.slot_bytes = region, fifos, tp_rank, slot_bytes
        tp_size = len(fifos)
        data = torch.frombuffer(region, dtype=torch.uint8)
        self.slots = [[data[_slot_offset(buffer, rank, tp_size, slot_bytes):][:slot_bytes] for rank in range(tp_size)]
                      for buffer in range(2)]
        self.counters = memoryview(region)[TOKEN_BYTES:TOKEN_BYTES + 8 * tp_size].cast("q")
        self.peers = [rank for rank in range(tp_size) if rank != tp_rank]
        self.views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
        self.spin_ns = poll_budget_ns(SPIN_US, tp_size)
        self.rounds = np.zeros(1, dtype=np.int64)  # this rank's count of rounds, which the C++ layer counts in too
        base = data.data_ptr()
        self.kernel_group = ShmGroup(base + _slot_offset(0, 0, tp_size, slot_bytes), slot_bytes, base + TOKEN_BYTES,
                                     self.rounds.ctypes.data, list(fifos), tp_rank, tp_size, self.spin_ns)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group in place, added in rank order, so every rank gets bit-identical results."""
        for chunk in self._chunks(x.view(-1)):
            _sum_in_rank_order(self._exchange(chunk), out=chunk)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x concatenated along the last dimension on TP rank 0; None on the other ranks."""
        x = x.contiguous()
        parts = [x] + [torch.empty_like(x) for _ in self.peers] if self.tp_rank == 0 else None
        chunk_size = self.slot_bytes // x.element_size()
        for index, chunk in enumerate(self._chunks(x.view(-1))):
            slots = self._exchange(chunk)
            if parts is not None:
                start = index * chunk_size
                for part, slot in zip(parts[1:], slots[1:]):
                    part.view(-1)[start:start + chunk.numel()].copy_(slot)
        return torch.cat(parts, dim=-1) if parts else None

    def close(self) -> None:
        self.counters.release()
        self.slots, self.views = [], {}  # the views must go before the mapping can close
        shm_region.release(self.region, self.fifos)

    def _chunks(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """flat in pieces that fit a slot; usually the one piece, which needs no split (a split costs ~6 us)."""
        chunk_size = self.slot_bytes // flat.element_size()
        return (flat,) if flat.numel() <= chunk_size else flat.split(chunk_size)

    def _exchange(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Publish my chunk for this round; every rank's chunk, as views into the slots, once all have theirs."""
        round_ = int(self.rounds[0])
        slots = self._slot_views(round_ % 2, chunk.numel(), chunk.dtype)
        slots[self.tp_rank].copy_(chunk)
        self.rounds[0] = round_ = round_ + 1
        self.counters[self.tp_rank] = round_  # after the copy: x86 makes stores visible in program order
        for peer in self.peers:
            shm_region.wake(self.fifos[peer])
        self._wait_for_peers()
        return slots

    def _slot_views(self, buffer: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's slot in `buffer` as numel elements of dtype; made once per shape, as making them costs
        more than the copy they serve."""
        key = (buffer, numel, dtype)
        if (views := self.views.get(key)) is None:
            if len(self.views) >= _MAX_CACHED_VIEWS:
                self.views.clear()
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            views = self.views[key] = [slot[:nbytes].view(dtype) for slot in self.slots[buffer]]
        return views

    def _wait_for_peers(self) -> None:
        if poll(self._peers_published, self.spin_ns):
            return
        while not self._peers_published():
            os.read(self.fifos[self.tp_rank], 4096)  # blocks until a peer publishes (or drains stale wake-ups)

    def _peers_published(self) -> bool:
        round_ = int(self.rounds[0])
        return all(self.counters[peer] >= round_ for peer in self.peers)


def connect_shm(group: dist.ProcessGroup, tp_rank: int, tp_size: int, name: str, directory: str = SHM_DIR,
                slot_bytes: int = SLOT_BYTES) -> ShmCommunicator | None:
    """Collective over `group`: TP rank 0 creates the files under a name unique to the group, every rank maps
    them and checks rank 0's random token, then rank 0 unlinks them (the mappings and open FIFOs keep them
    alive, so nothing is left behind even if a rank is SIGKILLed). None, to stay on gloo, unless every rank
    saw the token, that is unless the whole group shares this host's shared memory (and the host is x86)."""
    paths = ShmPaths.for_group(directory, name, tp_size)
    region_bytes = _region_bytes(tp_size, slot_bytes)
    token = torch.zeros(TOKEN_BYTES, dtype=torch.uint8)
    if tp_rank == 0 and (created := shm_region.create(paths, region_bytes)) is not None:
        token = torch.frombuffer(bytearray(created), dtype=torch.uint8)
    dist.broadcast(token, src=dist.get_global_rank(group, 0), group=group)
    mapped = shm_region.attach(paths, region_bytes, token.numpy().tobytes(), tp_rank) if token.any() else None
    everyone = torch.tensor([mapped is not None], dtype=torch.int32)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
    if tp_rank == 0:
        shm_region.unlink(paths)
    if not everyone.item():
        if mapped is not None:
            shm_region.release(*mapped)
        logger.warning("TP rank %d: not every rank of the group could map its shared memory; the group uses gloo",
                       tp_rank)
        return None
    return ShmCommunicator(*mapped, tp_rank, slot_bytes)


def _region_bytes(tp_size: int, slot_bytes: int) -> int:
    return _slot_offset(2, 0, tp_size, slot_bytes)


def _slot_offset(buffer: int, rank: int, tp_size: int, slot_bytes: int) -> int:
    return shm_region.header_bytes(TOKEN_BYTES + 8 * tp_size) + (buffer * tp_size + rank) * slot_bytes


def _sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """out = parts[0] + parts[1] + ..., added left to right; 16-bit floats accumulate in float32 and round once."""
    if out.dtype in (torch.float16, torch.bfloat16):
        total = parts[0].float()
        for part in parts[1:]:
            total.add_(part)
        out.copy_(total)
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)
