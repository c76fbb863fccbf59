"""ZmqConnector's transport: the prefill engine serves its transfer region's slots from a thread of its own (a ROUTER
at kv_ip:kv_port), and the decode engine pulls a transfer's slots by nonce into its own region (a DEALER), each slot
once; msgspec headers and raw frames, no pickle."""
from __future__ import annotations

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
        self.released.put((slots, pull.nonce))  # the transfer ends with this pull: every slot of it goes back
        if pull.release:
            return None
        headers, frames = self.region.snapshot(pull.slots)
        if any(int(nonce) != pull.nonce for nonce in headers[:, 0]):  # a slot reused since: not this transfer's
            return [self.encoder.encode(KVPulled(pull_id=pull.pull_id, error="overwritten"))]
        return [self.encoder.encode(KVPulled(pull_id=pull.pull_id, headers=headers.tolist())), *frames]


class TransferClient:
    """The decode engine's side: one connection to its group's prefill engine, used by the engine thread alone."""

    def __init__(self, region: TransferRegion, address: str, timeout_s: float) -> None:
        self.region, self.address, self.timeout_ms = region, address, int(timeout_s * 1000)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a producer not (or no longer) connected
        self.socket.connect(address)
        self.pull_ids = itertools.count(1)
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVPulled)

    def pull(self, nonce: int, slots: list[int]) -> list[int] | None:
        """The transfer's slots copied into this region's first len(slots) slots (those returned, for read() to
        check and load), or None: the producer unreachable or silent for the whole timeout, or refusing."""
        if len(slots) > self.region.num_slots:
            return None
        pull_id = next(self.pull_ids)
        deadline = time.monotonic() + self.timeout_ms / 1000
        if not self._send(KVPull(pull_id=pull_id, nonce=nonce, slots=slots), self.timeout_ms):
            return None
        while (left := deadline - time.monotonic()) > 0 and self.socket.poll(int(left * 1000) + 1):
            header, *frames = self.socket.recv_multipart(copy=False)
            try:
                reply = self.decoder.decode(header.buffer)
            except msgspec.DecodeError as error:
                logger.warning("kv transfer: a malformed reply from %s (%s)", self.address, error)
                return None
            if reply.pull_id != pull_id:
                continue  # the late answer to an earlier pull that timed out
            local = list(range(len(slots)))
            ok = reply.error is None and self.region.fill(local, reply.headers, [frame.buffer for frame in frames])
            return local if ok else None
        return None

    def release(self, nonce: int, slots: list[int]) -> None:
        """The transfer not needed (the decode engine's prefix cache held its blocks): its slots go back now."""
        self._send(KVPull(pull_id=0, nonce=nonce, slots=slots, release=True), 0)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    def _send(self, pull: KVPull, timeout_ms: int) -> bool:
        """Sent once the producer is connected (at once if it is), within timeout_ms."""
        if timeout_ms and not self.socket.poll(timeout_ms, zmq.POLLOUT):
            return False
        try:
            self.socket.send(self.encoder.encode(pull), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True
