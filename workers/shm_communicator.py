"""Tensor-parallel collectives for CPU ranks on one host: all-reduce and gather through shared memory, not gloo."""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import platform
import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.polling import poll, poll_budget_ns

SHM_DIR = "/dev/shm"
SLOT_BYTES = 4 << 20  # per rank and buffer; larger tensors go through in chunks of this size
# Waking a rank blocked on its FIFO takes 50-100 us on a shared VM, more than the ranks' usual skew at a
# collective: a waiter polls the peers' round counters this long before it blocks.
SPIN_US = int(os.environ.get("PAGEDSERVE_SHM_SPIN_US", "200"))
_TOKEN_BYTES = 16  # proves a rank mapped rank 0's file; the ranks' round counters (int64) follow it
_ALIGN = 64
# A peer's counter is read without a memory fence, so the slot it guards must not become visible after it:
# x86's stores are seen in program order. Other CPUs stay on gloo.
_ORDERED_STORE_MACHINES = ("x86_64", "amd64", "i386", "i686")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShmPaths:
    """The files one TP group shares: a region of slots [2][tp_size][slot_bytes] and one wake-up FIFO per rank."""

    region: str
    fifos: list[str]

    @classmethod
    def for_group(cls, directory: str, name: str, tp_size: int) -> ShmPaths:
        prefix = os.path.join(directory, name)
        return cls(f"{prefix}-slots", [f"{prefix}-rank{rank}.fifo" for rank in range(tp_size)])

    def all(self) -> list[str]:
        return [self.region, *self.fifos]


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
        self.counters = memoryview(region)[_TOKEN_BYTES:_TOKEN_BYTES + 8 * tp_size].cast("q")
        self.peers = [rank for rank in range(tp_size) if rank != tp_rank]
        self.spin_ns = poll_budget_ns(SPIN_US, tp_size)
        self.round = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group in place, added in rank order, so every rank gets bit-identical results."""
        for chunk in x.view(-1).split(self.slot_bytes // x.element_size()):
            _sum_in_rank_order(self._exchange(chunk), out=chunk)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x concatenated along the last dimension on TP rank 0; None on the other ranks."""
        x = x.contiguous()
        parts = [x] + [torch.empty_like(x) for _ in self.peers] if self.tp_rank == 0 else None
        chunk_size = self.slot_bytes // x.element_size()
        for index, chunk in enumerate(x.view(-1).split(chunk_size)):
            slots = self._exchange(chunk)
            if parts is not None:
                start = index * chunk_size
                for part, slot in zip(parts[1:], slots[1:]):
                    part.view(-1)[start:start + chunk.numel()].copy_(slot)
        return torch.cat(parts, dim=-1) if parts else None

    def close(self) -> None:
        for fd in self.fifos:
            os.close(fd)
        self.counters.release()
        self.slots = []  # the views must go before the mapping can close
        self.region.close()

    def _exchange(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Publish my chunk for this round; every rank's chunk, as views into the slots, once all have theirs."""
        nbytes = chunk.numel() * chunk.element_size()
        slots = [slot[:nbytes].view(chunk.dtype) for slot in self.slots[self.round % 2]]
        slots[self.tp_rank].copy_(chunk)
        self.round += 1
        self.counters[self.tp_rank] = self.round  # after the copy: x86 makes stores visible in program order
        for peer in self.peers:
            with contextlib.suppress(BlockingIOError):
                os.write(self.fifos[peer], b"\x01")
        self._wait_for_peers()
        return slots

    def _wait_for_peers(self) -> None:
        if poll(self._peers_published, self.spin_ns):
            return
        while not self._peers_published():
            os.read(self.fifos[self.tp_rank], 4096)  # blocks until a peer publishes (or drains stale wake-ups)

    def _peers_published(self) -> bool:
        return all(self.counters[peer] >= self.round for peer in self.peers)


def connect_shm(group: dist.ProcessGroup, tp_rank: int, tp_size: int, name: str, directory: str = SHM_DIR,
                slot_bytes: int = SLOT_BYTES) -> ShmCommunicator | None:
    """Collective over `group`: TP rank 0 creates the files under a name unique to the group, every rank maps
    them and checks rank 0's random token, then rank 0 unlinks them (the mappings and open FIFOs keep them
    alive, so nothing is left behind even if a rank is SIGKILLed). None, to stay on gloo, unless every rank
    saw the token, that is unless the whole group shares this host's shared memory (and the host is x86)."""
    paths = ShmPaths.for_group(directory, name, tp_size)
    token = torch.zeros(_TOKEN_BYTES, dtype=torch.uint8)
    if tp_rank == 0 and platform.machine().lower() in _ORDERED_STORE_MACHINES:
        token = _create(paths, tp_size, slot_bytes)
    dist.broadcast(token, src=dist.get_global_rank(group, 0), group=group)
    communicator = _open(paths, tp_rank, slot_bytes, token.numpy().tobytes()) if token.any() else None
    everyone = torch.tensor([communicator is not None], dtype=torch.int32)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
    if tp_rank == 0:
        _unlink(paths)
    if communicator is not None and not everyone.item():
        communicator.close()
        return None
    return communicator


def _create(paths: ShmPaths, tp_size: int, slot_bytes: int) -> torch.Tensor:
    """The files, and the token written into the region; zeros if they could not be made."""
    _unlink(paths)  # a start-up killed before its unlink left these: the live rendezvous port makes the name ours
    token = secrets.token_bytes(_TOKEN_BYTES)
    try:
        fd = os.open(paths.region, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a full /dev/shm fails here instead of as SIGBUS mid-step.
            os.posix_fallocate(fd, 0, _region_bytes(tp_size, slot_bytes))
            os.pwrite(fd, token, 0)
        finally:
            os.close(fd)
        for fifo in paths.fifos:
            os.mkfifo(fifo, 0o600)
    except OSError as error:
        logger.warning("shared-memory TP collectives unavailable (%s); using gloo", error)
        _unlink(paths)
        return torch.zeros(_TOKEN_BYTES, dtype=torch.uint8)
    return torch.frombuffer(bytearray(token), dtype=torch.uint8)


def _open(paths: ShmPaths, tp_rank: int, slot_bytes: int, token: bytes) -> ShmCommunicator | None:
    """Map the region and open every FIFO read-write (so opening never blocks); None if this is not the
    region rank 0 made."""
    tp_size = len(paths.fifos)
    try:
        fd = os.open(paths.region, os.O_RDWR)
        try:
            region = mmap.mmap(fd, _region_bytes(tp_size, slot_bytes))
        finally:
            os.close(fd)
    except (OSError, ValueError) as error:  # ValueError: the file is shorter than the mapping
        logger.warning("TP rank %d cannot map %s (%s); the group uses gloo", tp_rank, paths.region, error)
        return None
    if region[:_TOKEN_BYTES] != token:
        logger.warning("TP rank %d sees another %s than TP rank 0; the group uses gloo", tp_rank, paths.region)
        region.close()
        return None
    fifos = [os.open(fifo, os.O_RDWR | (0 if rank == tp_rank else os.O_NONBLOCK))
             for rank, fifo in enumerate(paths.fifos)]
    return ShmCommunicator(region, fifos, tp_rank, slot_bytes)


def _unlink(paths: ShmPaths) -> None:
    for path in paths.all():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _region_bytes(tp_size: int, slot_bytes: int) -> int:
    return _slot_offset(2, 0, tp_size, slot_bytes)


def _slot_offset(buffer: int, rank: int, tp_size: int, slot_bytes: int) -> int:
    header_bytes = -(-(_TOKEN_BYTES + 8 * tp_size) // _ALIGN) * _ALIGN
    return header_bytes + (buffer * tp_size + rank) * slot_bytes


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
