"""Shared-memory files one process creates and others on the same host map: a region that starts with a random
token, and a wake-up FIFO per participant. Used by the TP collectives and the engine's step channel."""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import platform
import secrets
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
TOKEN_BYTES = 16  # proves a process mapped the creator's file, not another host's or an older one
ALIGN = 64
# Readers of these regions see a counter without a memory fence, so the data it guards must not become visible
# after it: x86's stores are seen in program order. Other CPUs stay on the transports they fall back to.
_ORDERED_STORE_MACHINES = ("x86_64", "amd64", "i386", "i686")

logger = logging.getLogger(__name__)


def shared_memory_supported() -> bool:
    return platform.machine().lower() in _ORDERED_STORE_MACHINES


@dataclass(frozen=True)
class ShmPaths:
    """A region file and one wake-up FIFO per participant."""

    region: str
    fifos: list[str]

    @classmethod
    def for_group(cls, directory: str, name: str, num_fifos: int) -> ShmPaths:
        prefix = os.path.join(directory, name)
        return cls(f"{prefix}-slots", [f"{prefix}-{index}.fifo" for index in range(num_fifos)])

    def all(self) -> list[str]:
        return [self.region, *self.fifos]


def create(paths: ShmPaths, region_bytes: int) -> bytes | None:
    """The files, with a fresh token written at the region's start; None (and a warning) if they could not be
    made, or the CPU's store order does not allow shared-memory counters."""
    if not shared_memory_supported():
        return None
    unlink(paths)  # an earlier start-up killed before its unlink left these; the caller's name makes them ours
    token = secrets.token_bytes(TOKEN_BYTES)
    try:
        fd = os.open(paths.region, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a full /dev/shm fails here instead of as SIGBUS later.
            os.posix_fallocate(fd, 0, region_bytes)
            os.pwrite(fd, token, 0)
        finally:
            os.close(fd)
        for fifo in paths.fifos:
            os.mkfifo(fifo, 0o600)
    except OSError as error:
        logger.warning("shared memory unavailable (%s); falling back", error)
        unlink(paths)
        return None
    return token


def attach(paths: ShmPaths, region_bytes: int, token: bytes, own_fifo: int | None
           ) -> tuple[mmap.mmap, list[int]] | None:
    """Map the region and open every FIFO read-write (so opening never blocks); only own_fifo blocks on reads,
    the others are for waking their owners and never block on writes. None if this is not the creator's
    region (another host, or files already gone)."""
    try:
        fd = os.open(paths.region, os.O_RDWR)
        try:
            region = mmap.mmap(fd, region_bytes)
        finally:
            os.close(fd)
    except (OSError, ValueError) as error:  # ValueError: the file is shorter than the mapping
        logger.info("cannot map %s (%s)", paths.region, error)
        return None
    if region[:TOKEN_BYTES] != token:
        logger.info("%s is not the creator's region (another host?)", paths.region)
        region.close()
        return None
    try:
        fifos = [os.open(fifo, os.O_RDWR | (0 if index == own_fifo else os.O_NONBLOCK))
                 for index, fifo in enumerate(paths.fifos)]
    except OSError as error:
        logger.info("cannot open the FIFOs next to %s (%s)", paths.region, error)
        region.close()
        return None
    return region, fifos


def release(region: mmap.mmap, fifos: list[int]) -> None:
    """Undo attach(): close the FIFOs and unmap the region (views into it must be gone)."""
    for fd in fifos:
        os.close(fd)
    region.close()


def wake(fifo: int) -> None:
    """One byte to a FIFO opened without blocking; a full FIFO already holds wake-ups enough."""
    with contextlib.suppress(BlockingIOError):
        os.write(fifo, b"\x01")


def unlink(paths: ShmPaths) -> None:
    for path in paths.all():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def header_bytes(num_bytes: int) -> int:
    """num_bytes of header rounded up to the alignment the data after it starts at."""
    return -(-num_bytes // ALIGN) * ALIGN
