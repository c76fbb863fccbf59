"""A budget of concurrent requests per client, so one client's slow requests cannot hold the whole waiting queue:
past it, a 429. A client is its API key (the Authorization header) or, without one, its connection."""
from __future__ import annotations

import hashlib
from collections import Counter

from fastapi.responses import JSONResponse

from frontend.api.errors import error_body


class ClientBudget:
    """ASGI middleware: at most `max_requests` POST requests of one client in flight at once (a stream counts until
    its last event is sent)."""

    def __init__(self, app, max_requests: int) -> None:
        self.app, self.max_requests = app, max_requests
        self.in_flight: Counter[bytes] = Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        client = _client(scope)
        if self.in_flight[client] >= self.max_requests:
            body = error_body(429, f"this client already has {self.max_requests} requests in flight "
                                   "(--max-concurrent-requests-per-key); retry when one ends", code="too_many_requests")
            return await JSONResponse(body, status_code=429)(scope, receive, send)
        self.in_flight[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[client] -= 1
            if not self.in_flight[client]:
                del self.in_flight[client]


def _client(scope: dict) -> bytes:
    """The key's digest (never the key itself, kept in memory), else the connection's address and port."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return b"key:" + hashlib.sha256(value).digest()
    host, port = scope.get("client") or ("", 0)
    return f"connection:{host}:{port}".encode()
