"""Compiling constraints off the engine loop, in worker processes (compile_pool), with results cached by constraint
in a cache bounded in entries and in bytes."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from core.structured_output.backends import Backends, CompiledConstraint
from core.structured_output.compile_pool import CompilePool
from ipc import StructuredOutputsParams
from kernels.thread_priority import lowest_priority

CACHE_SIZE = 256  # compiled constraints (and compile errors) kept, least recently used dropped first

TIMED_OUT_SHARE = 0.9  # a compile stopped after this share of the timeout is remembered as timed out
Key = tuple[str, str, bool]


class GrammarCompiler:
    """Compiles each distinct constraint once; `compile` returns a future at once. Used from the engine loop's
    thread only. A compile nobody waits for any more is stopped (`give_up`); one that ran past the timeout is
    remembered as timed out, so the same constraint sent again fails at once instead of taking a worker again."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, timeout_s: float, memory_mb: int,
                 cache_bytes: int) -> None:
        self.backends = Backends(tokenizer_dir, vocab_size)
        self.timeout_s, self.cache_bytes = timeout_s, cache_bytes
        self.pool = CompilePool(self.backends, memory_mb)
        self._cache: OrderedDict[Key, Future[CompiledConstraint]] = OrderedDict()
        # The vocabulary tables (this process's and each worker's) come first, once; a request's compile timeout
        # counts from when they are ready (StructuredOutputManager), so a large vocabulary never times out the
        # first requests.
        self.tables_ready = threading.Event()
        self.tables_ready_at: float | None = None
        threading.Thread(target=self._build_tables, name="grammar-tables", daemon=True).start()

    def compile(self, params: StructuredOutputsParams) -> Future[CompiledConstraint]:
        """The compiled constraint (or its ValueError), shared by every request with the same one."""
        key = params.cache_key
        future = self._cache.get(key)
        if future is None or future.cancelled():
            future = self._cache[key] = self.pool.submit(params)
            self._evict()
        else:
            self._cache.move_to_end(key)
        return future

    def give_up(self, params: StructuredOutputsParams, future: Future) -> None:
        """No request waits for this compile any more: stop it (its worker process is killed if it runs)."""
        ran_s = self.pool.cancel(future)
        key = params.cache_key
        if self._cache.get(key) is not future:
            return
        # Its request's clock started a moment before the compile did: most of the timeout in the worker counts.
        if ran_s is not None and ran_s >= TIMED_OUT_SHARE * self.timeout_s:
            timed_out: Future = Future()
            timed_out.set_exception(ValueError(
                f"structured_outputs.{params.kind} took longer than {self.timeout_s:g} s to compile "
                "(--structured-outputs-compile-timeout)"))
            self._cache[key] = timed_out
        elif not future.done():
            del self._cache[key]

    def _evict(self) -> None:
        """Drop the least recently used entries past CACHE_SIZE, or past cache_bytes of compiled grammars."""
        total = sum(_size(future) for future in self._cache.values())
        while self._cache and (len(self._cache) > CACHE_SIZE or total > self.cache_bytes):
            _, future = self._cache.popitem(last=False)
            total -= _size(future)

    def _build_tables(self) -> None:
        lowest_priority()  # the engine's own neighbour otherwise: its forward would wait for it
        try:
            self.backends.build_tables()
            self.pool.wait_ready()
        finally:  # failed: each compile fails its request with the reason
            self.tables_ready_at = time.monotonic()
            self.tables_ready.set()

    def shutdown(self) -> None:
        self.pool.shutdown()


def _size(future: Future) -> int:
    """A cached entry's bytes: a compiled grammar's own size; errors and unfinished compiles count as nothing."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return 0
    return future.result().size_bytes
