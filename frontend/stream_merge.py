"""Merge several async streams into one of (stream index, item), in arrival order."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of every stream as they come; the first error raises. Closing the merged stream cancels the
    streams still running (an AsyncLLM stream aborts its request when cancelled)."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(stream, index, queue)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(stream: AsyncIterator[T], index: int, queue: asyncio.Queue) -> None:
    try:
        async for item in stream:
            queue.put_nowait((index, item))
        queue.put_nowait((index, _DONE))
    except Exception as error:
        queue.put_nowait((index, error))
