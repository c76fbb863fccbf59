"""AsyncEngineCoreClient: the ZMQ client library of an engine core for asyncio (AsyncLLM, the gateway)."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.core_client import DEFAULT_MAX_STALL_S, POLL_MS, EngineCoreClient, EngineDeadError, unwrap
from ipc import EngineCoreOutputs, SchedulerStats, SubscribeHeartbeats, UtilityResult

if TYPE_CHECKING:
    from core.engine_spawn import EngineProcess


class AsyncEngineCoreClient(EngineCoreClient):
    """The asyncio client: connects (and handshakes) synchronously, then a receiver task on the running loop
    reads outputs, resolves utility calls and wakes `get_outputs_async`."""

    def __init__(self, address: str, curve_key_file: str | None = None, handshake_timeout: float = 30.0,
                 process: EngineProcess | None = None) -> None:
        self.futures: dict[int, asyncio.Future] = {}
        self.heartbeats_subscribed = False
        self.outputs_ready: asyncio.Event | None = None
        self.receiver: asyncio.Task | None = None
        super().__init__(address, curve_key_file, handshake_timeout, process)  # handshakes synchronously
        self.async_output = zmq.asyncio.Socket.from_socket(self.output)
        self.async_monitors = [zmq.asyncio.Socket.from_socket(monitor) for monitor in self.monitors]
        self.async_poller = zmq.asyncio.Poller()
        for sock in (self.async_output, *self.async_monitors):
            self.async_poller.register(sock, zmq.POLLIN)

    async def get_outputs_async(self) -> EngineCoreOutputs:
        self._ensure_receiver()
        while not self.pending:
            self._raise_if_dead()
            self.outputs_ready.clear()
            await self.outputs_ready.wait()
        return self.pending.popleft()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_receiver()
        call_id = self._send_utility_call(method, args)
        future = self.futures[call_id] = asyncio.get_running_loop().create_future()
        return unwrap(await future)

    async def check_health_async(self, max_stall_s: float = DEFAULT_MAX_STALL_S) -> None:
        """Raise EngineDeadError saying why if the engine is not healthy (see health_problem); never waits. The
        first call subscribes to the engine's heartbeats (the receiver task then reads them as they come)."""
        self.subscribe_heartbeats()
        problem = self.health_problem(max_stall_s)
        if problem is not None:
            raise EngineDeadError(problem)

    def subscribe_heartbeats(self) -> None:
        """From now on the receiver task (started here, on the running loop) reads the engine's heartbeats."""
        self._ensure_receiver()
        if not self.heartbeats_subscribed and self.dead_reason is None:
            self._send(SubscribeHeartbeats())
            self.heartbeats_subscribed = True
            self.last_heartbeat = (time.monotonic(), 0.0)

    check_serving_async = check_health_async  # one engine: it serves only while it is healthy

    async def get_stats_async(self) -> SchedulerStats:
        return msgspec.convert(await self.call_utility_async("get_stats"), SchedulerStats)

    def _ensure_receiver(self) -> None:
        # A new receiver when the loop that ran the last one has ended (asyncio.run cancels leftover tasks).
        if self.receiver is None or self.receiver.done():
            self.outputs_ready = asyncio.Event()
            self.receiver = asyncio.get_running_loop().create_task(self._receive_loop())

    async def _receive_loop(self) -> None:
        try:
            while self.dead_reason is None:
                ready = dict(await self.async_poller.poll(POLL_MS))
                if self.async_output in ready:
                    self._accept(self.decoder.decode(await self.async_output.recv_multipart(copy=False)))
                for monitor in self.async_monitors:
                    if monitor in ready:
                        self._on_monitor_event(parse_monitor_message(await monitor.recv_multipart()))
                if not ready:
                    self._check_process()
        except Exception as error:  # a failing receiver must not leave callers waiting forever
            self._mark_dead(f"the client's receiver failed: {type(error).__name__}: {error}")
            raise

    def _accept(self, message: EngineCoreOutputs) -> None:
        super()._accept(message)
        if self.pending:
            self.outputs_ready.set()

    def _on_utility_result(self, result: UtilityResult) -> None:
        future = self.futures.pop(result.call_id, None)
        if future is None:
            super()._on_utility_result(result)
        elif not future.done():
            future.set_result(result)

    def _mark_dead(self, reason: str) -> None:
        super()._mark_dead(reason)
        for future in self.futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self.futures.clear()
        if self.outputs_ready is not None:
            self.outputs_ready.set()

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.cancel()
        super().shutdown()
