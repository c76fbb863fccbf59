"""The ZMQ client library of an engine core (sync; frontend.async_core_client adds asyncio) and its errors.

A client connects two DEALER sockets, both carrying its random routing id, to an engine core's input and
output endpoints (see ipc.sockets), so the engine routes this client's outputs to it alone. It learns that
the engine is gone from an EngineDead notice, from the output connection dropping, or (for an engine it
started) from the process exiting, and then every pending and later call raises EngineDeadError.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from ipc import (
    CLIENT_ALIVE_INTERVAL_S,
    AbortRequests,
    ClientAlive,
    Decoder,
    Encoder,
    EngineConfig,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    Heartbeat,
    RequestError,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)
from ipc.request_rules import InvalidRequestError
from ipc.sockets import CurveKeys, EngineEndpoints, connect_dealer, private_ipc_address

if TYPE_CHECKING:
    from core.engine_spawn import EngineProcess

POLL_MS = 100  # how often a waiting client checks that the engine process it started is alive
_HANDSHAKE_RETRY_S = 0.2
_EXIT_GRACE_S = 0.3  # after a disconnect, how long to wait for the engine's exit code (for the error message)
HEARTBEAT_TIMEOUT_S = 10.0  # this long without a heartbeat (sent every 0.5 s), the engine counts as gone
DEFAULT_MAX_STALL_S = 120.0  # an engine loop that has not advanced for this long (one step) counts as wedged
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class EngineDeadError(RuntimeError):
    """The engine core is gone: this request, and every later one, cannot complete."""


class EngineOverloadedError(RuntimeError):
    """The engine refused the request because its waiting queue is full; retrying later may succeed."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request alone (a bug it provoked); the engine and other requests go on."""


def request_error(error: RequestError) -> Exception:
    """The exception a refused or failed request raises in the front end."""
    if error.kind == "overloaded":
        return EngineOverloadedError(error.message)
    if error.kind == "failed":
        return RequestFailedError(f"the engine failed on request {error.request_id}: {error.message}")
    return ValueError(error.message) if error.param is None else InvalidRequestError(error.message, error.param)


class EngineCoreClient:
    """Sync client of an engine core at `address` (tcp://HOST:PORT or ipc://PATH).

    `EngineCoreClient.start(config)` starts a private engine core and connects to it; the client then owns it.
    """

    def __init__(self, address: str, curve_key_file: str | None = None, handshake_timeout: float = 30.0,
                 process: EngineProcess | None = None) -> None:
        self.endpoints = EngineEndpoints.from_address(address)
        self.process = process
        keys = CurveKeys.load(curve_key_file) if curve_key_file else None
        self.identity = uuid.uuid4().bytes
        self.context = zmq.Context()
        self.input = connect_dealer(self.context, self.endpoints.input, self.identity, keys)
        self.output = connect_dealer(self.context, self.endpoints.output, self.identity, keys)
        events = zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        self.monitors = [self.input.get_monitor_socket(events), self.output.get_monitor_socket(events)]
        self.encoder, self.decoder = Encoder(), Decoder(EngineCoreOutputs)
        self.poller = zmq.Poller()
        for sock in (self.output, *self.monitors):
            self.poller.register(sock, zmq.POLLIN)
        self.call_ids = itertools.count()
        self.awaited_calls: set[int] = set()
        self.utility_results: dict[int, UtilityResult] = {}
        self.pending: collections.deque[EngineCoreOutputs] = collections.deque()
        self.dead_reason: str | None = None
        self.connected = self.closed = False
        self.last_heartbeat = (time.monotonic(), 0.0)  # when it arrived, and the loop age it reported
        self.last_report: Heartbeat | None = None  # the last heartbeat itself: the engine's request counts
        # Sends come from the caller's thread and from the thread that tells the engine this client lives.
        self._send_lock = threading.Lock()
        self._stop_alive = threading.Event()
        self._alive_thread: threading.Thread | None = None
        try:
            self.info = self._handshake(handshake_timeout)
        except BaseException:
            self.shutdown()
            raise
        self._send(ClientAlive())  # before any request of ours, so the engine never holds one from an unknown client
        self._alive_thread = threading.Thread(target=self._tell_alive, name="engine-client-alive", daemon=True)
        self._alive_thread.start()

    @classmethod
    def start(cls, config: EngineConfig) -> EngineCoreClient:
        """A client of a new private engine core (ipc:// in a directory only this user can enter)."""
        from core.engine_spawn import EngineProcess  # only a client that starts an engine needs core

        address = private_ipc_address()
        process = EngineProcess(config, address)
        process.wait_ready()
        return cls(address, process=process)

    # -- sending --------------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            self._send(AbortRequests(request_ids))

    def _send(self, message: Any) -> None:
        self._raise_if_dead()
        with self._send_lock:
            self.input.send_multipart(self.encoder.encode(message), copy=False)

    def _tell_alive(self) -> None:
        """From before its first request until shutdown: the engine aborts this client's requests soon after these
        stop (it was killed)."""
        alive = Encoder().encode(ClientAlive())
        while not self._stop_alive.wait(CLIENT_ALIVE_INTERVAL_S):
            with self._send_lock:
                if self.closed:
                    return
                self.input.send_multipart(alive, copy=False)

    def _send_utility_call(self, method: str, args: tuple) -> int:
        call_id = next(self.call_ids)
        self._send(UtilityCall(call_id, method, list(args)))
        self.awaited_calls.add(call_id)
        return call_id

    # -- receiving ------------------------------------------------------------------------------------------
    def get_outputs(self) -> EngineCoreOutputs:
        """The next batch of this client's outputs (and request errors); EngineDeadError once those received
        before the engine died are consumed."""
        while not self.pending:
            self.poll(POLL_MS)
        return self.pending.popleft()

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run an engine utility (get_stats, reset_prefix_cache, start_profile, stop_profile, check_health)."""
        call_id = self._send_utility_call(method, args)
        while call_id not in self.utility_results:
            self.poll(POLL_MS)
        return unwrap(self.utility_results.pop(call_id))

    def poll(self, timeout_ms: int) -> None:
        """Take in what has arrived within `timeout_ms` (outputs, replies, disconnects); EngineDeadError once dead."""
        self._raise_if_dead()
        ready = dict(self.poller.poll(timeout_ms))
        if self.output in ready:
            self._accept(self.decoder.decode(self.output.recv_multipart(copy=False)))
        for monitor in self.monitors:
            if monitor in ready:
                self._on_monitor_event(recv_monitor_message(monitor))
        if not ready:
            self._check_process()
        self._raise_if_dead()

    def _accept(self, message: EngineCoreOutputs) -> None:
        if message.heartbeat is not None:
            self.last_heartbeat = (time.monotonic(), message.heartbeat.loop_age)
            self.last_report = message.heartbeat
        if message.utility_result is not None:
            self._on_utility_result(message.utility_result)
        if message.outputs or message.errors:
            self.pending.append(message)
        if message.engine_dead is not None:
            self._mark_dead(message.engine_dead.reason)

    def _on_utility_result(self, result: UtilityResult) -> None:
        if result.call_id in self.awaited_calls:  # not a late duplicate of a handshake reply
            self.awaited_calls.discard(result.call_id)
            self.utility_results[result.call_id] = result

    # -- liveness -------------------------------------------------------------------------------------------
    def _handshake(self, timeout: float) -> EngineInfo:
        """Ask for the engine's info until it answers: the answer proves the output route to us exists (the
        engine's ROUTER drops outputs for a client whose output connection is not up yet)."""
        deadline, next_try, call_ids = time.monotonic() + timeout, 0.0, []
        while time.monotonic() < deadline:
            if time.monotonic() >= next_try:
                call_ids.append(self._send_utility_call("get_info", ()))
                next_try = time.monotonic() + _HANDSHAKE_RETRY_S
            self.poll(50)
            answered = [call_id for call_id in call_ids if call_id in self.utility_results]
            if answered:
                self.awaited_calls.difference_update(call_ids)
                self.connected = True
                self.last_heartbeat = (time.monotonic(), 0.0)
                return msgspec.convert(unwrap(self.utility_results.pop(answered[0])), EngineInfo)
        raise ConnectionError(f"no engine core answered at {self.endpoints.input} within {timeout:.0f} s")

    def _on_monitor_event(self, event: dict) -> None:
        if event["event"] & _HANDSHAKE_FAILED:
            raise PermissionError(f"the engine core at {self.endpoints.input} refused this client: its CURVE key "
                                  "does not match (event "
                                  f"{event['event']}); give the engine's key file as curve_key_file")
        if event["event"] == zmq.EVENT_DISCONNECTED and self.connected:
            self._drain_output()  # an EngineDead notice sent just before the close says why
            if self.process is not None and self.process.wait_exit(_EXIT_GRACE_S):
                self._check_process()
            self._mark_dead(f"lost the connection to the engine core at {self.endpoints.input}")

    def _drain_output(self) -> None:
        while self.output.poll(0):
            self._accept(self.decoder.decode(self.output.recv_multipart(copy=False)))

    def _check_process(self) -> None:
        if self.process is not None and not self.process.is_alive():
            self.process.end_group()
            self._mark_dead(f"the engine core process exited (exit code {self.process.returncode})")

    def health_problem(self, max_stall_s: float = DEFAULT_MAX_STALL_S) -> str | None:
        """Why the engine is not healthy (gone, silent, or its loop stalled past max_stall_s), or None. Read from
        its heartbeats, which a long step does not delay, so it never waits for an answer."""
        if self.dead_reason is not None:
            return self.dead_reason
        received_at, loop_age = self.last_heartbeat
        silence = time.monotonic() - received_at
        if silence > HEARTBEAT_TIMEOUT_S:
            return f"no heartbeat from the engine core for {silence:.0f} s"
        if loop_age + silence > max_stall_s:
            return f"the engine core's loop has not advanced for {loop_age + silence:.0f} s"
        return None

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason

    def _raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    # -- typed utilities ------------------------------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        return msgspec.convert(self.call_utility("get_stats"), SchedulerStats)

    def shutdown(self) -> None:
        """Close the sockets; stop the engine process if this client started it."""
        if self.closed:
            return
        self._stop_alive.set()
        with self._send_lock:  # the alive thread sends no more
            self.closed = True
        for monitor in self.monitors:
            monitor.close(linger=0)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()
        if self.process is not None:
            self.process.shutdown()


def unwrap(result: UtilityResult) -> Any:
    """A utility call's result, or its error raised."""
    if result.error is not None:
        raise RuntimeError(result.error)
    return result.result
