"""A server-sent-event response fed from outside its task: emit() writes each event at once when the connection
takes it (through the BodyPusher of push.py), and otherwise queues it for the response's own task, which waits
for a slow reader."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from frontend.api.push import BODY_PUSH, BodyPusher

SSE_DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()  # several times faster than json.dumps on the per-token path


def sse_event(body: dict) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


class ChoiceEvents:
    """The per-token events of one stream: {**head, "choices": [choice], "usage": null}, with the head (id, object,
    created, model) encoded once rather than copied and encoded for every token."""

    def __init__(self, head: dict) -> None:
        self.prefix = b"data: " + _json.encode(head)[:-1] + (b',"choices":' if head else b'"choices":')
        self.suffix = b',"usage":null}\n\n'

    def event(self, choice: dict) -> bytes:
        return self.prefix + _json.encode([choice]) + self.suffix


class PushedSSEResponse(Response):
    """A 200 text/event-stream response: the pieces given to emit(), in order, then the one given to end().
    on_close runs when the response ends: finished, failed, or its client gone."""

    media_type = "text/event-stream"

    def __init__(self, on_close: Callable[[], None]) -> None:
        self.status_code, self.background, self.on_close = 200, None, on_close
        self.init_headers(None)
        self.pending: list[bytes] = []  # emitted but not yet written, oldest first
        self.tail: bytes | None = None
        self.pusher: BodyPusher | None = None  # set once the headers are out
        self.sending = False  # the task is writing queued pieces: a push now would overtake them
        self.wakeup: asyncio.Future[None] | None = None

    def emit(self, data: bytes) -> None:
        if self.tail is not None:
            return
        if self.pusher is not None and not self.pending and not self.sending and self.pusher.write(data):
            return
        self.pending.append(data)
        self._wake()

    def end(self, tail: bytes) -> None:
        """The last piece; later emit() and end() calls are ignored."""
        if self.tail is None:
            self.tail = tail
            self._wake()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = asyncio.ensure_future(_disconnect(receive))
        disconnected.add_done_callback(lambda _: self._wake())
        complete = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self.pusher = scope.get("extensions", {}).get(BODY_PUSH)
            while not disconnected.done():
                if self.pending:
                    body = b"".join(self.pending)
                    self.pending.clear()
                    self.sending = True
                    try:
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    finally:
                        self.sending = False
                elif self.tail is not None:
                    await send({"type": "http.response.body", "body": self.tail, "more_body": False})
                    complete = True
                    break
                else:
                    self.wakeup = asyncio.get_running_loop().create_future()
                    await self.wakeup
        finally:
            self.pusher = None
            disconnected.cancel()
            self.on_close()
        if complete and self.background is not None:
            await self.background()

    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
