"""The shared-memory step channel: every reader gets every message once and in order (multipart, empty, larger
than the whole ring), polling or blocking; the writer waits for lagging readers only; waits run their health
check; files of another creator are refused; nothing is left in the directory."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from workers.shm_channel import NUM_SLOTS, SLOT_BYTES, ShmChannel, attach_channel, create_channel
from workers.shm_region import ShmPaths, unlink

# Frames of the messages: multipart, empty ones, a message spanning more slots than the ring holds, small ones.
MESSAGES = [[b"one"], [b"", b"two", b""], [os.urandom(NUM_SLOTS * SLOT_BYTES + 12345), b"tail"]] + \
    [[f"message {i}".encode(), os.urandom(i)] for i in range(300)]


class HealthCheckFailed(Exception):
    pass


def open_channel(tmp_path: Path, num_readers: int, spin_ns: int) -> tuple[ShmChannel, list[ShmChannel]]:
    paths = ShmPaths.for_group(str(tmp_path), "test", num_readers)
    token = create_channel(paths)
    assert token is not None
    try:
        writer = attach_channel(paths, token, None, 0)
        readers = [attach_channel(paths, token, reader, spin_ns) for reader in range(num_readers)]
    finally:
        unlink(paths)
    assert not list(tmp_path.iterdir())  # mapped and open, but already unlinked
    return writer, readers


@pytest.mark.parametrize("spin_ns", [0, 200_000])
def test_every_reader_gets_every_message_in_order(tmp_path: Path, spin_ns: int) -> None:
    writer, readers = open_channel(tmp_path, 2, spin_ns)
    received: list[list[list[bytes]]] = [[], []]

    def read(reader: ShmChannel, into: list) -> None:
        for _ in MESSAGES:
            into.append([bytes(frame) for frame in reader.recv()])

    threads = [threading.Thread(target=read, args=(reader, into)) for reader, into in zip(readers, received)]
    for thread in threads:
        thread.start()
    for message in MESSAGES:
        writer.send(message)
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert received == [MESSAGES, MESSAGES]


def test_writer_waits_only_for_attached_readers(tmp_path: Path) -> None:
    """A reader that never attached (a rank on another host) is not waited for; one that lags is, and the
    writer runs its health check meanwhile."""
    writer, readers = open_channel(tmp_path, 2, 0)
    writer.readers = [0]
    for index in range(3 * NUM_SLOTS):
        writer.send([b"step %d" % index])
        assert bytes(readers[0].recv()[0]) == b"step %d" % index
    writer.readers = [0, 1]  # reader 1 has consumed nothing: its slots free up only when it reads

    def failing_check() -> None:
        raise HealthCheckFailed

    start = time.monotonic()
    with pytest.raises(HealthCheckFailed):
        writer.send([b"x"], on_idle=failing_check)
    assert time.monotonic() - start < 5


def test_blocked_reader_runs_its_health_check(tmp_path: Path) -> None:
    """The engine waiting for a reply notices a dead rank: its check runs every IDLE_CHECK_S while it waits."""
    _, readers = open_channel(tmp_path, 1, 0)
    calls = []

    def check() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise HealthCheckFailed

    start = time.monotonic()
    with pytest.raises(HealthCheckFailed):
        readers[0].recv(on_idle=check)
    assert 0.2 <= time.monotonic() - start < 5


def test_files_of_another_creator_are_refused(tmp_path: Path) -> None:
    paths = ShmPaths.for_group(str(tmp_path), "test", 1)
    token = create_channel(paths)
    try:
        assert attach_channel(paths, b"\0" * len(token), 0, 0) is None
        missing = ShmPaths.for_group(str(tmp_path / "elsewhere"), "test", 1)
        assert attach_channel(missing, token, 0, 0) is None
    finally:
        unlink(paths)
    assert not list(tmp_path.iterdir())


def test_big_steps_and_big_replies_in_flight_do_not_hang(tmp_path: Path) -> None:
    """Two batches in flight, steps and replies each larger than their ring: the rank blocks sending a reply
    while the engine blocks sending the next step, unless the engine reads replies ahead while it waits (as
    RayExecutor does)."""
    (tmp_path / "steps").mkdir()
    (tmp_path / "replies").mkdir()
    steps, (rank_steps,) = open_channel(tmp_path / "steps", 1, 0)
    rank_replies, (replies,) = open_channel(tmp_path / "replies", 1, 0)
    big = os.urandom(NUM_SLOTS * SLOT_BYTES + 1)

    def rank() -> None:
        for _ in range(4):
            step = bytes(rank_steps.recv()[0])
            rank_replies.send([step[:8] + big])

    def engine(collected: list[bytes]) -> None:
        def submit(index: int) -> None:
            steps.send([b"step %03d" % index + big], on_idle=replies.read_ahead)

        submit(0)
        for index in range(1, 5):
            if index < 4:
                submit(index)
            collected.append(bytes(replies.recv()[0])[:8])

    collected: list[bytes] = []
    threads = [threading.Thread(target=rank, daemon=True), threading.Thread(target=engine, args=(collected,),
                                                                             daemon=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert collected == [b"step %03d" % index for index in range(4)]
