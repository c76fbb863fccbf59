"""RequestOutputCollector: the pull side of a request — holds its outputs until the consumer (`async for`) takes them."""
from __future__ import annotations

import asyncio

from frontend.outputs import RequestOutput, merge_delta
from ipc import RequestOutputKind


class RequestOutputCollector:
    """An OutputCallback target (`put`) with an awaitable `get`. A consumer that falls behind gets one output per
    sample: DELTA outputs are concatenated, CUMULATIVE ones replaced by the newest. The request's final output
    (finished=True) is always the last one taken; an error is raised by get() once the outputs before it are taken."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self.pending: dict[int, RequestOutput] = {}  # sample index → its output not yet taken, oldest first
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None  # a bare future: cheaper per token than an asyncio.Event

    def put(self, item: RequestOutput | Exception) -> None:
        if isinstance(item, Exception):
            self.error = item
        else:
            index = item.outputs[0].index if len(item.outputs) == 1 else -1
            older = self.pending.pop(index, None)
            if older is not None and self.output_kind == RequestOutputKind.DELTA:
                item = merge_delta(older, item)
            self.pending[index] = item  # (re)inserted last: the finished output stays behind every other
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while not self.pending and self.error is None:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        if self.pending:
            return self.pending.pop(next(iter(self.pending)))
        raise self.error
