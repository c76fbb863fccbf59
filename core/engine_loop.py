"""EngineCoreProc, the engine-core process's loop: requests in over ZMQ, a busy loop (drain inputs → step →
outputs), outputs out.

A reader thread decodes what clients send and a writer thread encodes and sends outputs, so (de)serialization
overlaps the model's forward pass (torch releases the GIL). The main thread alone touches the EngineCore.
Request ids are scoped per client, so clients may reuse each other's ids and each sees only its own outputs.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from typing import Any

import msgspec
import zmq

from core.engine_clients import LivingClients, Peers, RateLimitedWarnings
from core.engine_core import EngineCore
from core.engine_heartbeat import Heart
from core.waves import WAVE_POLL_S, Waves
from ipc import (
    CLIENT_ALIVE_INTERVAL_S,
    CLIENT_SILENCE_S,
    AbortRequests,
    ClientAlive,
    Decoder,
    Encoder,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    RequestError,
    SubscribeHeartbeats,
    UtilityCall,
    UtilityResult,
)
from ipc.sockets import (
    CurveKeys,
    EngineEndpoints,
    bind_router,
    check_binding_is_safe,
    remove_ipc_files,
    start_authenticator,
)
from workers.expert_group import EngineGroupLost

logger = logging.getLogger("pagedserve.engine_core")
_STOP = None  # on the input queue: leave the loop
_SIGNAL_CHECK_S = 0.2
_IDLE_HEALTH_CHECK_S = 5.0  # while idle, how often the workers' health is checked (a dead rank ends the engine)
_CLIENT_GONE = object()  # on the input queue, from the heartbeat thread: this client went silent


class EngineCoreProc:
    def __init__(self, engine: EngineCore, endpoints: EngineEndpoints, keys: CurveKeys | None = None,
                 insecure_loopback: bool = False) -> None:
        check_binding_is_safe(endpoints, keys, insecure_loopback)
        self.engine = engine
        self.endpoints = endpoints
        self.context = zmq.Context()
        self.authenticator = start_authenticator(self.context, keys) if keys is not None else None
        self.input_socket = bind_router(self.context, endpoints.input, keys)
        self.output_socket = bind_router(self.context, endpoints.output, keys)
        self.inputs: queue.SimpleQueue = queue.SimpleQueue()  # (client identity, message) or _STOP
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()  # (client identity, EngineCoreOutputs) or _STOP
        self.client_identities: list[bytes] = []
        self.client_index: dict[bytes, int] = {}
        self.stop_reason = "the engine core shut down"
        self.held: dict[int, int] = defaultdict(int)  # client index → its requests the engine holds
        self.peers = Peers()  # the clients that subscribed to heartbeats
        self.living = LivingClients()  # the clients that promised ClientAlive messages
        self.last_health_check = time.monotonic()
        self.reader = threading.Thread(target=self._read_loop, name="engine-core-reader", daemon=True)
        self.writer = threading.Thread(target=self._write_loop, name="engine-core-writer", daemon=True)
        self.reader.start()
        self.writer.start()
        self.heart = Heart(self.peers, lambda identity, beat: self.outputs.put((identity, beat)), self._held_by)

    def request_stop(self, reason: str) -> None:
        """Safe from signal handlers and other threads: the loop ends after the current step."""
        self.stop_reason = reason
        self.inputs.put(_STOP)

    def run(self) -> None:
        """The busy loop; blocks on the input queue while there is nothing to compute."""
        try:
            if self.engine.waves is None:
                self._run_alone()
            else:
                self._run_waves(self.engine.waves)
        except EngineGroupLost as error:  # another engine's end, not this one's fault: no traceback
            # An idle group's first engine to stop (the front end shutting them all down) ends the others so too.
            log = logger.warning if self.engine.has_unfinished_requests() else logger.info
            log("%s", error)
            self.stop_reason = str(error)
        except Exception as error:
            logger.exception("the engine core failed")
            self.stop_reason = f"the engine core failed: {type(error).__name__}: {error}"
            raise
        finally:
            self._shutdown()

    def _run_alone(self) -> None:
        while self._drain_inputs(block=not self.engine.has_unfinished_requests()):
            self.heart.progressed(self.engine.scheduler)
            if self.engine.has_unfinished_requests():
                self._send_outputs(self.engine.step())
                self.heart.progressed(self.engine.scheduler)

    def _run_waves(self, waves: Waves) -> None:
        """The loop of an engine whose experts are split across the data-parallel engines (core/waves.py): it steps
        whenever any engine has work; while none has, it waits for input WAVE_POLL_S at a time."""
        while self._drain_inputs(block=not waves.live and not self.engine.has_unfinished_requests(),
                                 timeout=WAVE_POLL_S):
            if waves.next_step(self.engine):
                self._send_outputs(waves.step(self.engine))
            self.heart.progressed(self.engine.scheduler)

    def _drain_inputs(self, block: bool, timeout: float | None = None) -> bool:
        """Handle every queued input (waiting for the first if `block`, up to `timeout` if given); False when asked
        to stop."""
        try:
            item = self._wait_for_input(timeout) if block else self.inputs.get_nowait()
            while item is not _STOP:
                self._handle(*item)
                item = self.inputs.get_nowait()
            return False
        except queue.Empty:
            return True

    def _wait_for_input(self, timeout: float | None = None) -> Any:
        # A signal that lands on another thread (zmq's, torch's) cannot wake a main thread blocked on a lock,
        # and Python runs handlers only on the main thread: wake up now and then to let SIGTERM through.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                wait = _SIGNAL_CHECK_S if deadline is None else min(_SIGNAL_CHECK_S, deadline - time.monotonic())
                return self.inputs.get(timeout=max(wait, 0.0))
            except queue.Empty:
                self.heart.last_progress = now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise
                if now - self.last_health_check >= _IDLE_HEALTH_CHECK_S:
                    self.last_health_check = now
                    self.engine.check_health()  # raises, ending the engine, if a worker rank died

    def _handle(self, identity: bytes, message: Any) -> None:
        if message is _CLIENT_GONE:
            self._abort_client(identity)
        elif isinstance(message, EngineCoreRequest):
            self._add_request(identity, message)
        elif isinstance(message, AbortRequests):
            scoped = [self._scope(identity, request_id) for request_id in message.request_ids]
            self._send_outputs(self.engine.abort_requests(scoped))
        elif isinstance(message, UtilityCall):
            self.outputs.put((identity, EngineCoreOutputs(utility_result=self._call_utility(message))))
        else:  # an error found by the reader: pass it on in order with the client's other replies
            self.outputs.put((identity, message))

    def _add_request(self, identity: bytes, request: EngineCoreRequest) -> None:
        client_request_id = request.request_id
        try:
            scoped_id = self._scope(identity, client_request_id)
            self.engine.validate_request(request, scoped_id)
            request.request_id = scoped_id
        except ValueError as error:
            self._refuse(identity, RequestError(request_id=client_request_id, message=str(error),
                                                param=getattr(error, "param", None)))
            return
        if self.engine.is_overloaded():
            self._refuse(identity, RequestError(
                request_id=client_request_id, kind="overloaded", message="the engine's waiting queue is full "
                f"({self.engine.config.max_waiting_requests} requests); retry later"))
            return
        try:
            self.engine.add_request(request)
        except Exception as error:  # a bug this request provokes must not take the engine down
            logger.exception("adding request %s failed", request.request_id)
            self._refuse(identity, RequestError(request_id=client_request_id, kind="failed",
                                                message=f"{type(error).__name__}: {error}"))
            return
        self.held[self.client_index[identity]] += 1

    def _abort_client(self, identity: bytes) -> None:
        """A client went silent: its requests end (their outputs have no one to go to)."""
        index = self.client_index.get(identity)
        if index is None:
            return
        mine = [request_id for request_id in self.engine.request_ids() if request_id.startswith(f"{index}:")]
        if mine:
            logger.warning("client %s went silent: aborting its %d requests", identity.hex(), len(mine))
            self._send_outputs(self.engine.abort_requests(mine))  # a client that was only slow gets its finals

    def _held_by(self, identity: bytes) -> int:
        index = self.client_index.get(identity)
        return 0 if index is None else self.held.get(index, 0)

    def _refuse(self, identity: bytes, error: RequestError) -> None:
        self.outputs.put((identity, EngineCoreOutputs(errors=[error])))

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        try:
            return UtilityResult(call.call_id, result=self.engine.call_utility(call.method, call.args))
        except Exception as error:  # a bad method or argument must not take the engine down
            return UtilityResult(call.call_id, error=f"{call.method} failed: {type(error).__name__}: {error}")

    def _scope(self, identity: bytes, request_id: str) -> str:
        index = self.client_index.get(identity)
        if index is None:
            index = self.client_index[identity] = len(self.client_identities)
            self.client_identities.append(identity)
        return f"{index}:{request_id}"

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        if not outputs:
            return
        by_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        for output in outputs:
            index, _, output.request_id = output.request_id.partition(":")
            by_client[int(index)].append(output)
            if output.finish_reason is not None:
                self.held[int(index)] -= 1
        now = time.time()
        for index, client_outputs in by_client.items():
            self.outputs.put((self.client_identities[index], EngineCoreOutputs.of_step(client_outputs, now)))

    def _read_loop(self) -> None:
        decoder = Decoder(EngineCoreInput)
        warnings = RateLimitedWarnings()
        while True:
            try:
                if not self.input_socket.poll(int(CLIENT_ALIVE_INTERVAL_S * 1000)):
                    self._look_for_silent_clients()
                    continue
                frames = self.input_socket.recv_multipart(copy=False)
            except zmq.ContextTerminated:
                self.input_socket.close()
                return
            identity, body = frames[0].bytes, [frame.buffer for frame in frames[1:]]
            try:
                message = decoder.decode(body)
            except Exception as error:  # whatever a hostile frame provokes, this thread must live on
                warnings.warn(identity, error)
                message = _rejection(body, error)
            if isinstance(message, SubscribeHeartbeats):  # handled here: it must not wait behind a step
                self.peers.heard_from(identity)
            elif isinstance(message, ClientAlive):
                self.living.heard_from(identity)
            else:
                self.inputs.put((identity, message))
            if not self.input_socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._look_for_silent_clients()

    def _look_for_silent_clients(self) -> None:
        """Called with every message received so far read: a client is silent only if no ClientAlive of its waits
        unread, so a while in which this thread could not run (the GIL held elsewhere) makes no one look gone."""
        for identity in self.living.gone(time.monotonic() - CLIENT_SILENCE_S):
            self.inputs.put((identity, _CLIENT_GONE))

    def _write_loop(self) -> None:
        encoder = Encoder()
        while (item := self.outputs.get()) is not _STOP:
            identity, message = item
            self.output_socket.send_multipart([identity, *encoder.encode(message)], copy=False)
        self.output_socket.close()

    def _shutdown(self) -> None:
        self.heart.stop()
        dead = EngineCoreOutputs(engine_dead=EngineDead(reason=self.stop_reason))
        for identity in self.client_identities:
            self.outputs.put((identity, dead))
        self.outputs.put(_STOP)
        self.writer.join(timeout=5)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.context.term()  # wakes the reader, which closes its socket
        self.reader.join(timeout=5)
        remove_ipc_files(self.endpoints)  # also when the front end that would have done it is gone
        self.engine.shutdown()


def _rejection(body: list[memoryview], error: Exception) -> EngineCoreOutputs:
    """The error reply for an undecodable message, addressed to its request or call when that can be read."""
    message = f"malformed message: {error}"
    try:
        fields = msgspec.msgpack.decode(body[0]) if body else None
    except Exception:  # not even msgpack (or not valid UTF-8 inside): nothing to attribute it to
        fields = None
    fields = fields if isinstance(fields, dict) else {}
    call_id = fields.get("call_id")
    if isinstance(call_id, int) and not isinstance(call_id, bool):
        return EngineCoreOutputs(utility_result=UtilityResult(call_id, error=message))
    request_id = fields.get("request_id")
    request_id = request_id if isinstance(request_id, str) else ""
    return EngineCoreOutputs(errors=[RequestError(request_id=request_id, message=message)])
