"""The gateway's HTTP protocol: uvicorn's httptools protocol, extended to give every request a BodyPusher in
scope["extensions"] (writing a streamed response's body from outside its ASGI task), a deadline for its headers, and
OpenAI-style JSON errors for the requests the HTTP parser refuses.

A streamed completion writes one server-sent event per token. Through ASGI each event costs a task wake-up and a
chain of send() wrappers, about as much CPU as rendering and writing it; on a host where the engine wants every
core, that CPU comes out of the engine's throughput. With a pusher the engine's output handler writes each event
itself, whenever the connection takes it at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from http import HTTPStatus

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from frontend.api.errors import error_body

logger = logging.getLogger("pagedserve.api")
HEADER_TIMEOUT_S = 10.0
BODY_PUSH = "pagedserve.body_push"  # the key in scope["extensions"]
# What BodyPusher reads of uvicorn's request cycle: its internals, unchanged for years, checked once at run time.
_CYCLE_ATTRIBUTES = ("transport", "flow", "response_started", "response_complete", "chunked_encoding", "disconnected")


class BodyPusher:
    """Writes pieces of one response's chunked body straight to its connection, framed as uvicorn's send() does."""

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle

    def write(self, body: bytes) -> bool:
        """Write now if the response has started, is chunked and unfinished, and the connection is open and not
        paused by a slow reader. False: nothing was written; send it through ASGI, which waits for the reader."""
        cycle = self.cycle
        if (not cycle.response_started or cycle.response_complete or not cycle.chunked_encoding
                or cycle.disconnected or cycle.flow.write_paused or cycle.transport.is_closing()):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True


class PushHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a BodyPusher in each request's scope: `uvicorn.Config(app, http=this)`, or
    `http=functools.partial(this, header_timeout=S)`. If this uvicorn's request cycle lacks what the pusher reads, no
    scope gets one (everything goes through ASGI).

    uvicorn times out only idle keep-alive connections; a client that sends half a request line or header (or nothing)
    would hold its connection forever. Here a request's headers must be complete `header_timeout` seconds after the
    connection opened or the request began, or the connection is closed (with a 408 if a request had begun)."""

    compatible: bool | None = None  # known after the first request

    def __init__(self, *args, header_timeout: float = HEADER_TIMEOUT_S, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_deadline is None:  # a later request on a kept-alive connection
            self._start_header_deadline()

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this while handling the parser's error, which says what was wrong (a bad Content-Length...).
        error = sys.exc_info()[1]
        detail = f": {error}" if isinstance(error, httptools.HttpParserError) and str(error) else ""
        self._send_error(400, f"invalid HTTP request{detail}")

    def on_headers_complete(self) -> None:
        self._stop_header_deadline()
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is previous:  # no new request cycle (a protocol upgrade)
            return
        if PushHttpToolsProtocol.compatible is None:
            PushHttpToolsProtocol.compatible = all(hasattr(self.cycle, name) for name in _CYCLE_ATTRIBUTES)
            if not PushHttpToolsProtocol.compatible:
                logger.warning("this uvicorn's request cycle lacks %s: streamed events go through ASGI",
                               ", ".join(name for name in _CYCLE_ATTRIBUTES if not hasattr(self.cycle, name)))
        if PushHttpToolsProtocol.compatible:  # the cycle's ASGI task has not run yet
            self.cycle.scope.setdefault("extensions", {})[BODY_PUSH] = BodyPusher(self.cycle)

    def _start_header_deadline(self) -> None:
        self.header_deadline = self.loop.call_later(self.header_timeout, self._headers_overdue)

    def _stop_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_overdue(self) -> None:
        self.header_deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            # Pipelined headers behind a response still being written: a 408 now would cut into that response.
            self._start_header_deadline()
        elif self.scope is None:  # not a byte since the connection opened: nothing to answer
            self.transport.close()
        elif not self.transport.is_closing():
            self._send_error(408, f"the request headers did not arrive within {self.header_timeout:g} s")

    def _send_error(self, status: int, message: str) -> None:
        """An OpenAI-style error written straight to the connection, which then closes: there is no request (or it
        cannot be parsed) to answer through ASGI."""
        body = json.dumps(error_body(status, message)).encode()
        head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head.append(f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
                    .encode())
        self.transport.write(b"".join(head) + body)
        self.transport.close()
