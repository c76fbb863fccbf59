"""Server-sent events written from outside the response's task (frontend/api/push.py, sse.py), through a real
uvicorn server: order and completeness with a fast and a stalled reader, the ASGI fallback, disconnects."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from urllib.parse import parse_qs

import httpx
import pytest
import uvicorn
from starlette.background import BackgroundTask
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from conftest import wait_until
from frontend.api.push import BODY_PUSH, BodyPusher, PushHttpToolsProtocol
from frontend.api.sse import SSE_DONE, PushedSSEResponse


def piece(index: int, size: int) -> bytes:
    return b"data: %06d %b\n\n" % (index, b"x" * size)


class Feeder:
    """An ASGI app: GET /?n=N&size=S streams N pieces, emitted by another task (as the engine's output handler
    does), then [DONE]; n=0 streams until the client goes away. Records the responses that closed."""

    def __init__(self) -> None:
        self.closed = 0

    async def __call__(self, scope, receive, send) -> None:
        query = {key: int(values[0]) for key, values in parse_qs(scope["query_string"].decode()).items()}
        response = PushedSSEResponse(on_close=self._on_close)
        feeder = asyncio.ensure_future(self._feed(response, query["n"], query["size"]))
        try:
            await response(scope, receive, send)
        finally:
            feeder.cancel()

    async def _feed(self, response: PushedSSEResponse, n: int, size: int) -> None:
        await asyncio.sleep(0.05)  # the headers are out: from here on every piece can be pushed
        index = 0
        while n == 0 or index < n:
            response.emit(piece(index, size))
            index += 1
            await asyncio.sleep(0.001)
        response.end(SSE_DONE)

    def _on_close(self) -> None:
        self.closed += 1


class _SmallBuffers:
    """Mixed into a protocol: tiny socket and transport buffers, so a stalled reader pauses the writer at once."""

    def connection_made(self, transport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=4096)
        super().connection_made(transport)


class _SmallBuffersPush(_SmallBuffers, PushHttpToolsProtocol):
    pass


class _SmallBuffersASGI(_SmallBuffers, HttpToolsProtocol):
    pass


def _stalled_get(base_url: str, path: str) -> bytes:
    """GET with a 16 KiB receive buffer that reads nothing for half a second, then everything; the response body,
    de-chunked."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.connect((host, int(port)))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        time.sleep(0.5)
        raw = b""
        sock.settimeout(30)
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    body = b""
    while True:
        size_line, _, chunked = chunked.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body
        body, chunked = body + chunked[:size], chunked[size + 2:]


@pytest.fixture
def pushes(monkeypatch) -> Counter:
    """How many BodyPusher.write calls wrote (True) and refused (False)."""
    counts: Counter = Counter()
    write = BodyPusher.write

    def counted(self, body: bytes) -> bool:
        wrote = write(self, body)
        counts[wrote] += 1
        return wrote
    monkeypatch.setattr(BodyPusher, "write", counted)
    return counts


def serve(app: Feeder, http) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=http, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=10)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


@pytest.fixture(params=[PushHttpToolsProtocol, "httptools"], ids=["push", "asgi-only"])
def server(request):
    app = Feeder()
    base_url, server, thread = serve(app, request.param)
    yield app, base_url, request.param is PushHttpToolsProtocol
    server.should_exit = True
    thread.join(timeout=10)


def test_every_piece_arrives_in_order(server, pushes):
    app, base_url, pushed = server
    response = httpx.get(f"{base_url}/?n=300&size=40", timeout=30)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.content == b"".join(piece(i, 40) for i in range(300)) + SSE_DONE
    assert pushes[True] == (300 if pushed else 0)  # a reader keeping up: all written straight from the feeder
    assert wait_until(lambda: app.closed == 1, timeout=5)


def test_a_stalled_reader_gets_everything_in_order(pushes):
    """Small socket buffers and a reader that stalls while the feeder goes on: the connection pauses, then resumes
    while pieces keep coming; every piece arrives once, in order."""
    for http in (_SmallBuffersPush, _SmallBuffersASGI):
        app = Feeder()
        base_url, server, thread = serve(app, http)
        try:
            n, size = 1000, 1000  # a piece a millisecond: the feeder goes on for about as long after the stall
            body = _stalled_get(base_url, f"/?n={n}&size={size}")
            assert body == b"".join(piece(i, size) for i in range(n)) + SSE_DONE
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    assert pushes[False] > 0 and 0 < pushes[True] < n  # refused while paused, then pushed again once resumed


def test_a_client_that_goes_away_closes_the_response(server):
    app, base_url, _ = server
    with httpx.stream("GET", f"{base_url}/?n=0&size=40", timeout=30) as response:
        assert next(response.iter_bytes()).startswith(b"data: 000000")
    assert wait_until(lambda: app.closed == 1, timeout=5)


class _Wire:
    """Stands in for the connection: what reached it, in order, by push or by ASGI send; send() can be held."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.accepting = False  # the pusher's answer: the connection takes a push now
        self.held: asyncio.Event | None = None

    def write(self, body: bytes) -> bool:
        if self.accepting:
            self.received.append(body)
        return self.accepting

    async def send(self, message: dict) -> None:
        if self.held is not None:
            await self.held.wait()
        if message["type"] == "http.response.body":
            self.received.append(message["body"])


def test_a_push_never_overtakes_queued_pieces():
    async def scenario() -> list[bytes]:
        wire, gone = _Wire(), asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        response = PushedSSEResponse(on_close=lambda: None)
        response.background = BackgroundTask(wire.received.append, b"background")  # runs after the last piece
        task = asyncio.ensure_future(response({"type": "http", "extensions": {BODY_PUSH: wire}}, receive,
                                              wire.send))
        await asyncio.sleep(0)
        response.emit(b"1")  # refused (a paused connection): queued for the task
        wire.accepting = True
        response.emit(b"2")  # the connection takes pushes again, but 1 is still queued
        wire.held = asyncio.Event()
        await asyncio.sleep(0)  # the task now sends 1 2, held
        response.emit(b"3")  # while the task's send is pending
        wire.held.set()
        await asyncio.sleep(0.01)
        response.emit(b"4")  # nothing queued, nothing being sent: pushed
        response.end(b"5")
        await asyncio.wait_for(task, 5)
        return wire.received

    assert asyncio.run(scenario()) == [b"12", b"3", b"4", b"5", b"background"]
