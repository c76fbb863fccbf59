"""The gateway's HTTP protocol (frontend/api/push.py) through a real uvicorn server: a deadline for a request's
headers, and OpenAI-style JSON for requests the HTTP parser refuses."""
from __future__ import annotations

import functools
import json
import socket
import threading
import time

import pytest
import uvicorn
from starlette.responses import PlainTextResponse

from conftest import wait_until
from frontend.api.push import PushHttpToolsProtocol

HEADER_TIMEOUT_S = 0.5


async def _hello(scope, receive, send) -> None:
    await PlainTextResponse("hello")(scope, receive, send)


@pytest.fixture(scope="module")
def address():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    protocol = functools.partial(PushHttpToolsProtocol, header_timeout=HEADER_TIMEOUT_S)
    server = uvicorn.Server(uvicorn.Config(_hello, http=protocol, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=10)
    yield sock.getsockname()
    server.should_exit = True
    thread.join(timeout=10)


def _until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start = time.monotonic()
    sock.settimeout(timeout)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received, time.monotonic() - start


def _assert_hello(sock: socket.socket) -> None:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    received = b""
    while not received.endswith(b"hello"):
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {received!r}"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")


def _json_error(response: bytes) -> tuple[int, dict]:
    head, body = response.split(b"\r\n\r\n", 1)
    assert b"content-type: application/json" in head.lower()
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.mark.parametrize("partial", [b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"GE"])
def test_a_request_whose_headers_stall_gets_408_and_is_closed(address, partial):
    with socket.create_connection(address) as sock:
        sock.sendall(partial)
        response, waited = _until_closed(sock, timeout=10 * HEADER_TIMEOUT_S)
    assert HEADER_TIMEOUT_S * 0.9 <= waited < 5 * HEADER_TIMEOUT_S
    status, error = _json_error(response)
    assert status == 408 and error["type"] == "invalid_request_error" and "headers" in error["message"]


def test_a_connection_that_sends_nothing_is_closed_without_a_response(address):
    with socket.create_connection(address) as sock:
        response, waited = _until_closed(sock, timeout=10 * HEADER_TIMEOUT_S)
    assert response == b"" and waited < 5 * HEADER_TIMEOUT_S


def test_the_deadline_starts_again_with_each_request_on_a_kept_alive_connection(address):
    with socket.create_connection(address) as sock:
        time.sleep(HEADER_TIMEOUT_S * 0.6)
        _assert_hello(sock)
        time.sleep(HEADER_TIMEOUT_S * 0.6)  # past the first deadline: the connection is still open
        _assert_hello(sock)
        sock.sendall(b"GET / HTTP/1.1\r\n")
        response, _ = _until_closed(sock, timeout=10 * HEADER_TIMEOUT_S)
    assert _json_error(response)[0] == 408


@pytest.mark.parametrize("length", [b"abc", b"-5", b"1e3"])
def test_a_bad_content_length_gets_a_json_400(address, length):
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %b\r\n\r\n{}" % length)
        response, _ = _until_closed(sock, timeout=5)
    status, error = _json_error(response)
    assert status == 400 and "Content-Length" in error["message"], error
