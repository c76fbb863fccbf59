"""A one-writer, many-reader message ring in shared memory: the engine's per-step broadcast to the ranks on its
host, and the driver rank's reply, without ZMQ's I/O threads and the loopback TCP stack in between."""
from __future__ import annotations

import mmap
import os
import select
import struct
import time
from collections import deque
from typing import Callable

from ipc.serialization import Frame
from workers import shm_region
from workers.polling import poll
from workers.shm_region import SHM_DIR, TOKEN_BYTES, ShmPaths

SLOT_BYTES = 1 << 20
NUM_SLOTS = 4
IDLE_CHECK_S = 0.1  # a blocked reader or writer calls its on_idle (a health check) this often
_SLOT_HEADER = struct.Struct("<IB")  # payload length, last chunk of its message
_SLOT_HEADER_BYTES = 8
_FRAME_COUNT = struct.Struct("<I")
_FRAME_LENGTH = struct.Struct("<Q")

OnIdle = Callable[[], None]


class ShmChannel:
    """Chunk k of the stream goes in slot k % NUM_SLOTS. The writer copies it in, publishes written = k + 1 and
    wakes every reader through its FIFO; a reader waits until written > k (polling for spin_ns, then blocking on
    its FIFO), copies the chunk out and publishes consumed[reader] = k + 1. The writer reuses a slot once every
    reader in `readers` has consumed it. A message is a run of chunks, the last one flagged. Counters are read
    without fences, which x86's store order makes safe (shm_region.create refuses other CPUs)."""

    def __init__(self, region: mmap.mmap, fifos: list[int], reader: int | None, spin_ns: int) -> None:
        self.region, self.fifos, self.reader, self.spin_ns = region, fifos, reader, spin_ns
        self.counters = memoryview(region)[TOKEN_BYTES:TOKEN_BYTES + 8 * (1 + len(fifos))].cast("q")
        self.first_slot = _first_slot(len(fifos))
        self.readers = list(range(len(fifos)))  # the writer's view: who must consume a chunk before its slot is reused
        self.next_chunk = 0
        self.partial: list[bytes] = []  # a reader's chunks of a message whose last chunk has not come yet
        self.messages: deque[list[memoryview]] = deque()  # a reader's messages read ahead, oldest first

    def send(self, frames: list[Frame], on_idle: OnIdle | None = None) -> None:
        """Write one message for every reader (waiting for free slots if readers lag by NUM_SLOTS chunks)."""
        message = _pack(frames)
        capacity = SLOT_BYTES - _SLOT_HEADER_BYTES
        for start in range(0, max(len(message), 1), capacity):
            chunk = message[start:start + capacity]
            self._wait(self._slot_free, None, on_idle)
            offset = self._slot_offset()
            self.region[offset + _SLOT_HEADER_BYTES:offset + _SLOT_HEADER_BYTES + len(chunk)] = chunk
            _SLOT_HEADER.pack_into(self.region, offset, len(chunk), start + capacity >= len(message))
            self.next_chunk += 1
            self.counters[0] = self.next_chunk  # after the slot's bytes: x86 keeps stores in order
            for reader in self.readers:
                shm_region.wake(self.fifos[reader])

    def recv(self, on_idle: OnIdle | None = None) -> list[memoryview]:
        """The next message's frames."""
        while not self.messages:
            self._wait(self._chunk_ready, self.fifos[self.reader], on_idle)
            self.read_ahead()
        return self.messages.popleft()

    def read_ahead(self) -> None:
        """Take every chunk written so far out of the ring (freeing its slot), without waiting: a writer blocked
        on a full ring can go on even while this reader is busy elsewhere."""
        while self._chunk_ready():
            offset = self._slot_offset()
            length, last = _SLOT_HEADER.unpack_from(self.region, offset)
            self.partial.append(self.region[offset + _SLOT_HEADER_BYTES:offset + _SLOT_HEADER_BYTES + length])
            self.next_chunk += 1
            self.counters[1 + self.reader] = self.next_chunk
            if last:
                chunks, self.partial = self.partial, []
                self.messages.append(_unpack(chunks[0] if len(chunks) == 1 else b"".join(chunks)))

    def close(self) -> None:
        self.counters.release()
        shm_region.release(self.region, self.fifos)

    def _slot_offset(self) -> int:
        return self.first_slot + (self.next_chunk % NUM_SLOTS) * SLOT_BYTES

    def _slot_free(self) -> bool:
        return all(self.counters[1 + reader] > self.next_chunk - NUM_SLOTS for reader in self.readers)

    def _chunk_ready(self) -> bool:
        return self.counters[0] > self.next_chunk

    def _wait(self, ready: Callable[[], bool], fifo: int | None, on_idle: OnIdle | None) -> None:
        """Poll for spin_ns, then block: on the FIFO when there is one to wake us, else in short sleeps (a writer
        waits for slots only when readers lag far behind). on_idle runs every IDLE_CHECK_S meanwhile."""
        if poll(ready, self.spin_ns):
            return
        last_check = time.monotonic()
        while not ready():
            if fifo is None:
                time.sleep(1e-4)
            elif select.select([fifo], [], [], IDLE_CHECK_S)[0]:
                os.read(fifo, 4096)  # wake-ups only; stale ones just make us check again
            if on_idle is not None and time.monotonic() - last_check >= IDLE_CHECK_S:
                on_idle()
                last_check = time.monotonic()


def executor_channel_paths(name: str, num_ranks: int, directory: str = SHM_DIR) -> tuple[ShmPaths, ShmPaths]:
    """An engine's two channels: steps (the engine writes, every rank reads) and replies (the driver rank writes,
    the engine reads)."""
    return (ShmPaths.for_group(directory, f"{name}-steps", num_ranks),
            ShmPaths.for_group(directory, f"{name}-replies", 1))


def create_channel(paths: ShmPaths) -> bytes | None:
    """Make the files (before anyone attaches); their token, or None when this host cannot share memory."""
    return shm_region.create(paths, _region_bytes(len(paths.fifos)))


def attach_channel(paths: ShmPaths, token: bytes, reader: int | None, spin_ns: int) -> ShmChannel | None:
    """The channel as its writer (reader=None) or as reader `reader`; None when the files are not the creator's
    (another host)."""
    mapped = shm_region.attach(paths, _region_bytes(len(paths.fifos)), token, reader)
    return None if mapped is None else ShmChannel(*mapped, reader, spin_ns)


def _first_slot(num_readers: int) -> int:
    return shm_region.header_bytes(TOKEN_BYTES + 8 * (1 + num_readers))


def _region_bytes(num_readers: int) -> int:
    return _first_slot(num_readers) + NUM_SLOTS * SLOT_BYTES


def _pack(frames: list[Frame]) -> bytes:
    """[frame count][each frame's length][the frames' bytes]."""
    lengths = [memoryview(frame).nbytes for frame in frames]
    header = _FRAME_COUNT.pack(len(frames)) + b"".join(_FRAME_LENGTH.pack(n) for n in lengths)
    return b"".join([header, *frames])


def _unpack(message: bytes) -> list[memoryview]:
    view = memoryview(message)
    (count,) = _FRAME_COUNT.unpack_from(view)
    offset = _FRAME_COUNT.size + count * _FRAME_LENGTH.size
    frames = []
    for index in range(count):
        (length,) = _FRAME_LENGTH.unpack_from(view, _FRAME_COUNT.size + index * _FRAME_LENGTH.size)
        frames.append(view[offset:offset + length])
        offset += length
    return frames
