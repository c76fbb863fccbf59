"""ZmqConnector's transport: the prefill engine serves its transfer region's slots from a thread of its own (a ROUTER
at kv_ip:kv_port), and the decode engine pulls a transfer's slots by nonce (a DEALER, never waited on) into its own
region, each slot once; msgspec headers and raw frames, no pickle."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time

import msgspec
import zmq

from ipc.kv_transfer import KVPull, KVPulled
from workers.kv_transfer import TransferRegion

logger = logging.getLogger(__name__)
_POLL_MS = 100  # how often the server thread looks at its stop flag


class TransferServer:
    """The prefill engine's side. The engine thread announces each transfer (`offer`) and, between its writes, takes
    the slots the decode engine is done with (`take_released`): the region's headers are written by that one thread.
    A pull is answered only for a transfer still offered, for its own slots, before its deadline."""

    def __init__(self, region: TransferRegion, address: str, hold_s: float) -> None:
        self.region, self.hold_s = region, hold_s
        self.offered: dict[int, tuple[float, list[int]]] = {}  # nonce → (deadline, slots)
        self.released: queue.SimpleQueue[tuple[list[int], int]] = queue.SimpleQueue()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(address)
        except zmq.ZMQError as error:
            self.socket.close(linger=0)
            self.context.term()
            raise ValueError(f"kv_transfer_config: cannot serve KV at {address} ({error}); pick another kv_ip or "
                             "kv_port") from None
        self.decoder, self.encoder = msgspec.msgpack.Decoder(KVPull), msgspec.msgpack.Encoder()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="kv-transfer-server", daemon=True)
        self.thread.start()

    def offer(self, nonce: int, slots: list[int]) -> None:
        self.offered[nonce] = (time.monotonic() + self.hold_s, slots)

    def take_released(self) -> None:
        """Free the slots of transfers pulled or released since, and of those held past their deadline."""
        now = time.monotonic()
        for nonce, (deadline, slots) in list(self.offered.items()):
            if deadline < now and self.offered.pop(nonce, None) is not None:
                self.region.release(slots, nonce)
        while not self.released.empty():
            self.region.release(*self.released.get())

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close(linger=0)
        self.context.term()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(_POLL_MS):
                continue
            identity, *frames = self.socket.recv_multipart(copy=False)
            try:
                if len(frames) != 1:
                    raise msgspec.DecodeError(f"{len(frames)} frames, expected 1")
                pull = self.decoder.decode(frames[0].buffer)
            except msgspec.DecodeError as error:
                logger.warning("kv transfer: a malformed pull (%s) answered with an error", error)
                self.socket.send_multipart([identity, self.encoder.encode(KVPulled(pull_id=0, error=str(error)))])
                continue
            reply = self._answer(pull)
            if reply is not None:
                self.socket.send_multipart([identity, *reply], copy=False)

    def _answer(self, pull: KVPull) -> list | None:
        deadline, slots = self.offered.pop(pull.nonce, (0.0, []))
        if deadline < time.monotonic() or not set(pull.slots) <= set(slots):
            error = "no such transfer (never offered, pulled already, or past its deadline)"
            return None if pull.release else [self.encoder.encode(KVPulled(pull_id=pull.pull_id, error=error))]
        if pull.release:
            self.released.put((slots, pull.nonce))
            return None
        headers, frames = self.region.snapshot(pull.slots)
        # The transfer ends with this pull: its slots go back only once copied, or the engine thread could rewrite
        # one before the copy (a recompute for a pull served in time).
        self.released.put((slots, pull.nonce))
        if any(int(nonce) != pull.nonce for nonce in headers[:, 0]):  # a slot reused since: not this transfer's
            return [self.encoder.encode(KVPulled(pull_id=pull.pull_id, error="overwritten"))]
        return [self.encoder.encode(KVPulled(pull_id=pull.pull_id, headers=headers.tolist())), *frames]


class TransferClient:
    """The decode engine's side: one connection to its group's prefill engine, used by the engine thread alone and
    never waited on: a pull is sent (once the producer is connected) and its answer taken by poll() at a step
    boundary, while ZMQ's own I/O thread moves the bytes."""

    def __init__(self, region: TransferRegion, address: str, timeout_s: float) -> None:
        self.region, self.address, self.timeout_s = region, address, timeout_s
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a producer not (or no longer) connected
        self.socket.connect(address)
        self.pull_ids = itertools.count(1)
        self.pulls: dict[int, _Pull] = {}  # pull id → a pull not yet answered
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVPulled)

    def start(self, nonce: int, slots: list[int]) -> int | None:
        """A pull of the transfer's slots, sent now if the producer is connected (else by a later poll); its id, or
        None where the slots could never fit this region."""
        if len(slots) > self.region.num_slots:
            return None
        pull_id = next(self.pull_ids)
        pull = self.pulls[pull_id] = _Pull(KVPull(pull_id=pull_id, nonce=nonce, slots=slots),
                                           time.monotonic() + self.timeout_s)
        pull.sent = self._send(pull.message)
        return pull_id

    def poll(self) -> list[tuple[int, Answer | None]]:
        """Without waiting: the pulls that ended since, each with its answer (headers and frames, for load()) or
        None: refused, malformed, or unanswered past its deadline (kv_pull_timeout_s from its start)."""
        ended: list[tuple[int, Answer | None]] = []
        for pull in self.pulls.values():
            pull.sent = pull.sent or self._send(pull.message)
        while self.socket.poll(0):
            header, *frames = self.socket.recv_multipart(copy=False)
            pull_id, answer = self._answer(header.buffer, frames)
            pull = self.pulls.pop(pull_id, None)
            if pull is not None:  # else the late answer to one that timed out or was dropped
                ended.append((pull_id, answer if answer is not None and len(answer[0]) == len(pull.message.slots)
                              else None))
        now = time.monotonic()
        for pull_id in [pull_id for pull_id, pull in self.pulls.items() if pull.deadline <= now]:
            del self.pulls[pull_id]
            ended.append((pull_id, None))
        return ended

    def wait(self, timeout_s: float) -> None:
        """Until an answer may have come, a pull may be sent or one's deadline passes (at most timeout_s)."""
        if not self.pulls:
            return
        now = time.monotonic()
        timeout_s = min(timeout_s, max(0.0, min(pull.deadline for pull in self.pulls.values()) - now))
        unsent = any(not pull.sent for pull in self.pulls.values())
        self.socket.poll(int(timeout_s * 1000) + 1, zmq.POLLIN | (zmq.POLLOUT if unsent else 0))

    def cancel(self, pull_id: int) -> None:
        """Not wanted any more (its request aborted): an answer that still comes is dropped."""
        self.pulls.pop(pull_id, None)

    def load(self, answer: Answer, first: int) -> list[int] | None:
        """An answer's slots from its `first` on, copied into this region's first slots (those returned, for
        read() to check and load), or None where its frames do not have the sizes of its slots."""
        headers, frames = answer
        local = list(range(len(headers)))
        return local[first:] if self.region.fill(local, headers, frames) else None

    def release(self, nonce: int, slots: list[int]) -> None:
        """The transfer not needed (the decode engine's prefix cache held its blocks): its slots go back now."""
        self._send(KVPull(pull_id=0, nonce=nonce, slots=slots, release=True))

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    def _answer(self, header: memoryview, frames: list[zmq.Frame]) -> tuple[int, Answer | None]:
        """(the pull it answers, 0 if none can be read; its headers and frames, None for an error or a malformed
        answer)."""
        try:
            reply = self.decoder.decode(header)
        except msgspec.DecodeError as error:
            logger.warning("kv transfer: a malformed reply from %s (%s)", self.address, error)
            with contextlib.suppress(msgspec.DecodeError):
                fields = msgspec.msgpack.decode(header)
                if isinstance(fields, dict) and type(fields.get("pull_id")) is int:
                    return fields["pull_id"], None
            return 0, None
        if reply.error is not None:
            return reply.pull_id, None
        return reply.pull_id, (reply.headers, [frame.buffer for frame in frames])

    def _send(self, pull: KVPull) -> bool:
        """Sent if the producer is connected, never waiting."""
        try:
            self.socket.send(self.encoder.encode(pull), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True


Answer = tuple[list[list[int]], list[memoryview]]  # a pull's answer: each slot's header words, a frame per KV cache


@dataclasses.dataclass
class _Pull:
    message: KVPull
    deadline: float
    sent: bool = False
