"""Writing a streamed response's body from outside its ASGI task: uvicorn's httptools protocol, extended to give
every request a BodyPusher in scope["extensions"].

A streamed completion writes one server-sent event per token. Through ASGI each event costs a task wake-up and a
chain of send() wrappers, about as much CPU as rendering and writing it; on a host where the engine wants every
core, that CPU comes out of the engine's throughput. With a pusher the engine's output handler writes each event
itself, whenever the connection takes it at once.
"""
from __future__ import annotations

import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

logger = logging.getLogger("pagedserve.api")
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
    """uvicorn's httptools protocol with a BodyPusher in each request's scope: `uvicorn.Config(app, http=this)`.
    If this uvicorn's request cycle lacks what the pusher reads, no scope gets one (everything goes through ASGI)."""

    compatible: bool | None = None  # known after the first request

    def on_headers_complete(self) -> None:
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
