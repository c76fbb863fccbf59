"""The gateway's outer ASGI guard: the API key (Authorization: Bearer KEY or x-api-key: KEY) and the size caps on
headers and body."""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from frontend.api.errors import error_body


class Guard:
    """ASGI middleware: the API key on every route but /health (constant-time compares), and size caps on the
    headers and the body (checked here, whichever HTTP parser uvicorn picked)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app, self.max_body_bytes, self.max_header_bytes = app, max_body_bytes, max_header_bytes
        self.bearer = f"Bearer {api_key}".encode() if api_key else None
        self.key = api_key.encode() if api_key else None  # Anthropic's clients send it as x-api-key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(name) + len(value) for name, value in scope["headers"]) > self.max_header_bytes:
            return await _send(send, 431, f"the request headers are over the limit of {self.max_header_bytes} bytes")
        headers = dict(scope["headers"])
        if self.bearer is not None and _route_path(scope) != "/health" and not self._authorized(headers):
            return await _send(send, 401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            return await _send(send, 400, "the Content-Length header is not a non-negative integer")
        if int(length) > self.max_body_bytes:
            return await _send(send, 413, self._too_large())
        await self.app(scope, self._capped(receive), send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        # Both compares always run (| rather than or): the time taken says nothing about which header matched.
        return (hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
                | hmac.compare_digest(headers.get(b"x-api-key", b""), self.key))

    def _capped(self, receive):
        received = 0

        async def capped():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:  # a chunked body without Content-Length
                # FastAPI turns other errors while reading the body into a 400, but lets an HTTPException through.
                raise HTTPException(413, self._too_large())
            return message
        return capped

    def _too_large(self) -> str:
        return f"the request body is over the limit of {self.max_body_bytes} bytes"


def _route_path(scope: dict) -> str:
    """The path the routes see: uvicorn puts --root-path in front of the path it received (the ASGI rule)."""
    root, path = scope.get("root_path", ""), scope["path"]
    return path[len(root):] if root and path.startswith(root) else path


async def _send(send, status: int, message: str) -> None:
    response = JSONResponse(error_body(status, message), status_code=status)
    await response({"type": "http"}, None, send)
