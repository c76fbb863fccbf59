"""Compiling constraints off the engine loop: a few low-priority daemon threads, results cached by constraint."""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from core.structured_output.backends import Backends, CompiledConstraint
from ipc import StructuredOutputsParams

CACHE_SIZE = 256  # compiled constraints (and compile errors) kept, least recently used dropped first
# A compile cannot be interrupted: a grammar that takes minutes holds its thread that long. With several threads
# the next constraints still compile beside it (until this many slow ones arrive at once).
COMPILE_THREADS = 4


class GrammarCompiler:
    """Compiles each distinct constraint once, on background threads; `compile` returns a future at once. Used
    from the engine loop's thread only.

    The threads run at the lowest CPU priority: a slow grammar takes only the cycles the engine's step leaves.
    A compile cannot be interrupted: one past its deadline finishes in the background (and is cached); one not
    yet started when its last request gives up is cancelled.
    """

    def __init__(self, tokenizer_dir: str, vocab_size: int) -> None:
        self.backends = Backends(tokenizer_dir, vocab_size)
        self._cache: OrderedDict[tuple[str, str, bool], Future[CompiledConstraint]] = OrderedDict()
        self._jobs: queue.SimpleQueue[tuple[StructuredOutputsParams, Future] | None] = queue.SimpleQueue()
        # The vocabulary tables come first, once; a request's compile timeout counts from when they are ready
        # (StructuredOutputManager), so a large vocabulary never times out the first requests.
        self.tables_ready = threading.Event()
        self.tables_ready_at: float | None = None
        # Daemon threads, not an executor: a grammar still compiling must not hold up the exit of an in-process
        # engine.
        threading.Thread(target=self._build_tables, name="grammar-tables", daemon=True).start()
        for index in range(COMPILE_THREADS):
            threading.Thread(target=self._run, name=f"grammar-compiler-{index}", daemon=True).start()

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

    def _build_tables(self) -> None:
        _lowest_priority()
        try:
            self.backends.build_tables()
        finally:  # failed: each compile tries again and fails its request with the reason
            self.tables_ready_at = time.monotonic()
            self.tables_ready.set()

    def _run(self) -> None:
        _lowest_priority()
        self.tables_ready.wait()
        while (job := self._jobs.get()) is not None:
            params, future = job
            if not future.set_running_or_notify_cancel():
                continue  # every request waiting for it gave up before it started
            try:
                future.set_result(self.backends.compile(params))
            except Exception as error:  # delivered to the waiting requests; the thread goes on
                future.set_exception(error)

    def shutdown(self) -> None:
        for _ in range(COMPILE_THREADS):
            self._jobs.put(None)


def _lowest_priority() -> None:
    """This thread (Linux: the policy is per thread) runs only when a CPU would otherwise idle: SCHED_IDLE is
    preempted as soon as an engine thread wakes; nice 19 alone still held a core for whole time slices, which
    stalled the forward's other threads at their barriers (~20% slower decode steps)."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
