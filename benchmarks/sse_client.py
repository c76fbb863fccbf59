"""A lean HTTP/1.1 client for one streamed POST: an asyncio protocol over httptools' response parser.

The serving benchmark runs on the host it measures. aiohttp spent about 40 µs of CPU per streamed token there (a
task wake-up and two readline calls per server-sent event), CPU taken from the server under test. Here each TCP
segment that arrives is one callback that splits out its events and stamps them with the arrival time: the
benchmark's client CPU is about 21 µs per token, JSON decoding included.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools


@dataclass
class StreamedResponse:
    """A response: its status, and for a 200 the payload of each `data:` line with the time it arrived
    (perf_counter); for any other status, the body."""
    status: int = 0
    events: list[tuple[float, bytes]] = field(default_factory=list)
    body: bytes = b""


class _Protocol(asyncio.Protocol):
    def __init__(self, request: bytes, done: asyncio.Future[StreamedResponse]) -> None:
        self.request, self.done = request, done
        self.parser = httptools.HttpResponseParser(self)
        self.response = StreamedResponse()
        self.pending = b""  # the unfinished tail of the event stream
        self.arrival = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.arrival = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._finish(error)

    def on_headers_complete(self) -> None:
        self.response.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.response.status != 200:
            self.response.body += body
            return
        pending = self.pending + body
        if b"\n\n" not in pending:
            self.pending = pending
            return
        *events, self.pending = pending.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):  # not blank separators, comments, `event:` lines
                    self.response.events.append((self.arrival, line[5:].strip()))

    def on_message_complete(self) -> None:
        self._finish(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionError("the server closed the connection before the response ended"))

    def _finish(self, error: Exception | None) -> None:
        if not self.done.done():
            if error is None:
                self.done.set_result(self.response)
            else:
                self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()


async def post_streamed(url: str, body: bytes, headers: dict[str, str], connect_timeout: float,
                        response_timeout: float) -> StreamedResponse:
    """POST `body` (JSON) to an http:// `url` on a new connection and read the whole response. Raises OSError,
    httptools.HttpParserError or asyncio.TimeoutError."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"only http://host[:port]/path URLs are supported, not {url!r}")
    port = parts.port or 80
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.hostname}:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n{head}\r\n"
               ).encode() + body
    loop = asyncio.get_running_loop()
    done: asyncio.Future[StreamedResponse] = loop.create_future()
    transport, _ = await asyncio.wait_for(loop.create_connection(lambda: _Protocol(request, done), parts.hostname,
                                                                 port), connect_timeout)
    try:
        return await asyncio.wait_for(done, response_timeout)
    finally:
        transport.close()
