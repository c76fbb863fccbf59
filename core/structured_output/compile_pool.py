"""Grammar compiles in worker processes, killed when nobody waits for their result any more (xgrammar's compiles
cannot be interrupted any other way), in two lanes: small constraints have a worker of their own, so one client's
huge schemas never hold up everyone's small ones."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec

from core.engine_spawn import child_env
from core.structured_output.backends import Backends
from ipc import StructuredOutputsParams
from ipc.grammar_compile import CompileJob, CompileResult, WorkerReady, read_frame, write_frame
from kernels.thread_priority import lowest_priority

# A constraint whose text is at most this long goes to the small lane (or the other one when that is idle); a
# longer one waits for the other lane only.
SMALL_SPEC_CHARS = 4096
_EXIT_WAIT_S = 5.0


class CompileCancelled(Exception):
    """The compile was stopped because no request waits for it any more."""


@dataclass
class _Job:
    job_id: int
    params: StructuredOutputsParams
    small: bool
    future: Future = field(default_factory=Future)
    lane: _Lane | None = None
    started: float = 0.0
    killed: bool = False


class CompilePool:
    """`submit` returns a future at once; `cancel` stops a compile nobody waits for. Used from one thread (the engine
    loop's); each lane has a thread of its own that feeds its worker and rebuilds the results in this process."""

    def __init__(self, backends: Backends, memory_mb: int) -> None:
        self.backends, self.memory_mb = backends, memory_mb
        self._cond = threading.Condition()
        self._queues: dict[bool, deque[_Job]] = {True: deque(), False: deque()}  # by small
        self._jobs: dict[Future, _Job] = {}
        self._ids = itertools.count()
        self._closed = False
        self.lanes = [_Lane(self, "small", small_only=True), _Lane(self, "any", small_only=False)]
        for lane in self.lanes:
            lane.thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every lane's worker has its vocabulary tables (or failed to get them)."""
        return all(lane.ready.wait(timeout) for lane in self.lanes)

    def submit(self, params: StructuredOutputsParams) -> Future:
        job = _Job(next(self._ids), params, small=len(params.spec) <= SMALL_SPEC_CHARS)
        if job.small and not self.lanes[0].up_once.is_set():
            # The first worker is still importing its libraries (seconds): a small constraint compiles here
            # meanwhile, on a thread at idle priority, so an engine's first constrained requests need not wait.
            threading.Thread(target=self._compile_here, args=(job,), name="grammar-compile-early", daemon=True).start()
            return job.future
        with self._cond:
            self._jobs[job.future] = job
            self._queues[job.small].append(job)
            self._cond.notify_all()
        return job.future

    def cancel(self, future: Future) -> float | None:
        """Stop this compile: dropped if still queued, its worker killed if running. The seconds it had run, if it
        was running."""
        with self._cond:
            job = self._jobs.pop(future, None)
        if job is None or future.cancel() or future.done():
            return None
        job.killed = True
        job.lane.kill()
        return time.monotonic() - job.started

    def _compile_here(self, job: _Job) -> None:
        lowest_priority()
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(self.backends.compile(job.params))
        except Exception as error:  # the constraint's ValueError (400) or a backend's bug (500), as from a worker
            job.future.set_exception(error)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for lane in self.lanes:
            lane.close()

    def _take(self, lane: _Lane) -> _Job | None:
        """The lane's next job (small ones first on the small lane, large ones first on the other); None at shutdown."""
        with self._cond:
            while not self._closed:
                for small in (True,) if lane.small_only else (False, True):
                    while self._queues[small]:
                        job = self._queues[small].popleft()
                        job.lane, job.started = lane, time.monotonic()  # before it is seen running
                        if job.future.set_running_or_notify_cancel():
                            return job
                self._cond.wait()
            return None

    def _finished(self, job: _Job) -> None:
        with self._cond:
            self._jobs.pop(job.future, None)


class _Lane:
    def __init__(self, pool: CompilePool, name: str, small_only: bool) -> None:
        self.pool, self.name, self.small_only = pool, name, small_only
        self.process: subprocess.Popen | None = None
        self.start_error: str | None = None
        self.closed = False
        self.ready = threading.Event()  # its worker is up (or failed to start), not starting
        self.up_once = threading.Event()  # a worker of this lane has been up
        self._process_lock = threading.Lock()
        self._decoder = msgspec.msgpack.Decoder(CompileResult)
        self.thread = threading.Thread(target=self._run, name=f"grammar-compile-{name}", daemon=True)

    def kill(self) -> None:
        with self._process_lock:
            if self.process is not None and self.process.poll() is None:
                self.process.kill()

    def close(self) -> None:
        """Kill the worker for good: no new one starts."""
        with self._process_lock:
            self.closed = True
        self.kill()
        if self.process is not None:
            self.process.wait()

    def _run(self) -> None:
        # Only on CPU time the engine leaves idle: this thread (restoring a large grammar) and the workers it starts,
        # which inherit its policy from their first instruction (their imports alone take seconds of CPU).
        lowest_priority()
        self._start_worker()
        while (job := self.pool._take(self)) is not None:
            try:
                self._compile(job)
            finally:
                self.pool._finished(job)
            if self.process is None or self.process.poll() is not None:
                self._start_worker()  # after a kill, a crash or running out of memory: ready for the next job

    def _start_worker(self) -> None:
        self.ready.clear()
        try:
            self._start_process()
        finally:
            self.ready.set()
            self.up_once.set()

    def _start_process(self) -> None:
        command = [sys.executable, "-m", "core.structured_output.compile_worker", "--tokenizer-dir",
                   self.pool.backends.tokenizer_dir, "--vocab-size", str(self.pool.backends.vocab_size),
                   "--memory-mb", str(self.pool.memory_mb), "--parent-pid", str(os.getpid())]
        with self._process_lock:
            if self.closed:
                self.start_error = "the engine is shutting down"
                return
            self.process = process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                      env=child_env())
        body = read_frame(process.stdout)
        ready = msgspec.msgpack.decode(body, type=WorkerReady) if body is not None else WorkerReady(
            error=f"the grammar compile worker exited at start-up (code {process.wait()})")
        self.start_error = ready.error

    def _compile(self, job: _Job) -> None:
        future, kind = job.future, job.params.kind
        if self.start_error is not None:
            future.set_exception(RuntimeError(self.start_error))
            return
        try:
            write_frame(self.process.stdin, CompileJob(job_id=job.job_id, params=job.params))
            body = read_frame(self.process.stdout)
        except OSError:  # the worker is gone: killed or crashed
            body = None
        if body is None:
            code = self.process.wait()
            future.set_exception(CompileCancelled() if job.killed else ValueError(
                f"structured_outputs.{kind} could not be compiled: its compile worker exited (code {code})"))
            return
        result = self._decoder.decode(body)
        if result.error is not None:
            future.set_exception(RuntimeError(result.error) if result.engine_fault else ValueError(result.error))
            if result.worker_exits:
                try:
                    self.process.wait(_EXIT_WAIT_S)
                except subprocess.TimeoutExpired:
                    self.kill()
            return
        try:
            future.set_result(self.pool.backends.restore(job.params, result.backend, result.payload))
        except Exception as error:  # a backend's bug: this request's 500
            future.set_exception(error)
