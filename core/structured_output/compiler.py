"""Compiling constraints off the engine loop: one low-priority daemon thread, results cached by constraint."""
from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future

from core.structured_output.backends import Backends, CompiledConstraint
from ipc import StructuredOutputsParams

CACHE_SIZE = 256  # compiled constraints (and compile errors) kept, least recently used dropped first


class GrammarCompiler:
    """Compiles each distinct constraint once, on a background thread; `compile` returns a future at once. Used
    from the engine loop's thread only.

    The thread runs at the lowest CPU priority: a slow grammar takes only the cycles the engine's step leaves.
    A compile cannot be interrupted: one past its deadline finishes in the background (and is cached); one not
    yet started when its last request gives up is cancelled.
    """

    def __init__(self, tokenizer_dir: str, vocab_size: int) -> None:
        self.backends = Backends(tokenizer_dir, vocab_size)
        self._cache: OrderedDict[tuple[str, str, bool], Future[CompiledConstraint]] = OrderedDict()
        self._jobs: queue.SimpleQueue[tuple[StructuredOutputsParams, Future] | None] = queue.SimpleQueue()
        # A daemon thread, not a pool: a grammar still compiling must not hold up the exit of an in-process engine.
        self._thread = threading.Thread(target=self._run, name="grammar-compiler", daemon=True)
        self._thread.start()

    def compile(self, params: StructuredOutputsParams) -> Future[CompiledConstraint]:
        """The compiled constraint (or its ValueError), shared by every request with the same one."""
        key = params.cache_key
        future = self._cache.get(key)
        if future is None or future.cancelled():
            future = self._cache[key] = Future()
            self._jobs.put((params, future))
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return future

    def _run(self) -> None:
        _lowest_priority()
        while (job := self._jobs.get()) is not None:
            params, future = job
            if not future.set_running_or_notify_cancel():
                continue  # every request waiting for it gave up before it started
            try:
                future.set_result(self.backends.compile(params))
            except Exception as error:  # delivered to the waiting requests; the thread goes on
                future.set_exception(error)

    def shutdown(self) -> None:
        self._jobs.put(None)


def _lowest_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: the calling thread alone
    except (AttributeError, OSError):
        pass
