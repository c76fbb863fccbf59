"""How many threads a CPU rank's forward runs on: the CPUs this process may use, one fewer while it must share them.

Every parallel region of a step ends in a barrier. With as many threads as CPUs and one more runnable process
beside them, the barrier waits, region after region, for whichever thread the kernel has just descheduled (and
OpenMP's waiters spin meanwhile): a step slows many times over, where one thread fewer leaves that thread a CPU of
its own and loses only its share of the work. So the count follows what the threads see, between steps: the share
of their runnable time they spent waiting for a CPU (a neighbour's demand), and the CPU time that stayed idle (room
for one more). Time taken by idle-priority work is not idle: such a neighbour still stalls the barriers. The
engine's own background work (its idle-priority threads and the processes they start: grammar compile workers, the
kernels' build) is no neighbour: its threads' waiting is not counted, and its CPU time is room for one more.
docs/neighbours.md has the measurements behind the thresholds.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ipc import EngineConfig
from ipc.config import cpu_lists
from kernels import cpu_extension
from kernels.thread_priority import runs_in_background
from workers.cpu_limits import usable_cpus

logger = logging.getLogger(__name__)

WINDOW_S = 0.2  # how often the count is reconsidered (between steps)
# One thread fewer when the forward's threads waited this share of their runnable time; one more when this many CPUs
# (of the ones this process may use) stayed idle. Between the two, the count stays. The share down is where one
# thread fewer starts to win (docs/neighbours.md): below it, the waiting of a small neighbour (our own front end, a
# shell) costs less than the thread would.
WAITING_SHARE_DOWN = 0.2
IDLE_CPUS_UP = 0.6
BUSY_CPUS = 0.5  # the waiting share counts only in a window where the threads were runnable this many CPUs' worth
# The forward's threads: those runnable (running or waiting) this share of a window or more. The process's helper
# threads (ZeroMQ's I/O, the output sender) run for moments and often wait behind the forward's spinning team: their
# waiting is the team's doing, not a neighbour's.
FORWARD_THREAD_SHARE = 0.25
# After a step down, no step up for HOLD_S; doubled (up to MAX_HOLD_S) each time a step up is undone within
# FLAP_S, so a neighbour that comes and goes costs a few probes, not one every window.
HOLD_S, MAX_HOLD_S, FLAP_S = 0.5, 16.0, 2.0


@dataclass(frozen=True)
class Reading:
    """Cumulative counters at one moment: each thread's time running and waiting to run (ns) by thread id, each
    CPU's idle time (s) among those this process may use, and the CPU time (s) of the engine's background work by
    thread or process id."""

    at: float
    threads: dict[int, tuple[int, int]]
    idle_s: dict[int, float]
    background_s: dict[int, float] = field(default_factory=dict)

    def runnable_since(self, earlier: Reading) -> tuple[int, int]:
        """(ns running or waiting, ns waiting) since `earlier` of the forward's threads: those both readings saw that
        were runnable FORWARD_THREAD_SHARE of the time between or more."""
        runnable = waiting = 0
        least = FORWARD_THREAD_SHARE * (self.at - earlier.at) * 1e9
        for thread in self.threads.keys() & earlier.threads.keys():
            ran = self.threads[thread][0] - earlier.threads[thread][0]
            waited = self.threads[thread][1] - earlier.threads[thread][1]
            if ran + waited >= least:
                runnable, waiting = runnable + ran + waited, waiting + waited
        return runnable, waiting

    def idle_cpus_since(self, earlier: Reading) -> float:
        """CPUs idle on average since `earlier`, over the CPUs both readings counted (the mask may change)."""
        seconds = sum(self.idle_s[cpu] - earlier.idle_s[cpu] for cpu in self.idle_s.keys() & earlier.idle_s.keys())
        return seconds / (self.at - earlier.at)

    def background_cpus_since(self, earlier: Reading) -> float:
        """CPUs the engine's background work took on average since `earlier` (the tasks both readings saw)."""
        tasks = self.background_s.keys() & earlier.background_s.keys()
        return sum(self.background_s[task] - earlier.background_s[task] for task in tasks) / (self.at - earlier.at)


def read_schedule(process: str = "self") -> Reading:
    """Linux's per-thread scheduler statistics of a process (this one, or a pid's) and per-CPU times (nothing counted
    where the files are missing)."""
    threads, background = {}, {}
    tasks = _task_ids(f"/proc/{process}/task")
    for task in tasks:
        try:
            with open(f"/proc/{process}/task/{task}/schedstat", "rb") as stats:
                fields = stats.read().split()
            counters = (int(fields[0]), int(fields[1]))
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
        if runs_in_background(task):
            background[task] = counters[0] / 1e9
        else:
            threads[task] = counters
    background.update(_background_processes([f"/proc/{process}/task/{task}" for task in tasks]))
    cpus = os.sched_getaffinity(0 if process == "self" else int(process))
    return Reading(time.monotonic(), threads, _idle_seconds(cpus), background)


def _task_ids(folder: str) -> list[int]:
    try:
        return [int(task) for task in os.listdir(folder)]
    except (OSError, ValueError):
        return []


def _background_processes(parents: list[str]) -> dict[int, float]:
    """CPU seconds so far of each background process these tasks started, and of theirs (a build's compilers)."""
    seconds: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    while parents:
        try:
            with open(f"{parents.pop()}/children", "rb") as children:
                pids = [int(pid) for pid in children.read().split()]
        except (OSError, ValueError):  # an older kernel without the file, or a task that ended
            continue
        for pid in pids:
            if pid in seconds or not runs_in_background(pid):
                continue
            try:
                with open(f"/proc/{pid}/stat", "rb") as stat:
                    fields = stat.read().rpartition(b")")[2].split()
                seconds[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime of all its threads
            except (OSError, ValueError, IndexError):
                continue
            parents += [f"/proc/{pid}/task/{task}" for task in _task_ids(f"/proc/{pid}/task")]
    return seconds


def _idle_seconds(cpus: set[int]) -> dict[int, float]:
    idle = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/stat", "rb") as stat:
            for line in stat:
                if not line.startswith(b"cpu") or line[3:4] == b" ":
                    continue
                fields = line.split()
                if (cpu := int(fields[0][3:])) in cpus:
                    idle[cpu] = (int(fields[4]) + int(fields[5])) / tick  # idle, iowait
    except (OSError, ValueError, IndexError):
        return {}
    return idle


class ComputeThreads:
    """The thread count of this process's forward (torch's and the C++ kernels' OpenMP team), reconsidered by
    adjust() between steps. `fixed`: always that many; `pin`: run once on the forward's thread (pinning its team);
    `clock`: the one `read` stamps its readings with."""

    def __init__(self, fixed: int | None = None, pin: Callable[[], None] | None = None,
                 read: Callable[[], Reading] = read_schedule, limit: Callable[[], int] = usable_cpus,
                 apply: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fixed, self._pin, self._read, self._limit, self._apply = fixed, pin, read, limit, apply
        self._clock = clock
        self.count = fixed or limit()
        self._thread: int | None = None
        self._last: Reading | None = read() if fixed is None else None  # a fixed count reads no counters
        self._hold, self._no_up_before, self._last_up = HOLD_S, 0.0, float("-inf")

    def adjust(self) -> int:
        """The count for the next step (changed at most once a window, by at most one); call on the thread that
        runs the forward, since OpenMP's thread count belongs to the thread that sets it."""
        if self._thread != threading.get_native_id():
            self._thread = threading.get_native_id()
            self._apply(self.count)
            if self._pin is not None:
                self._pin()
        # A reading opens a few files a thread: once a window, not once a step.
        if self.fixed is not None or self._clock() - self._last.at < WINDOW_S:
            return self.count
        now = self._read()
        seconds = now.at - self._last.at
        runnable, waiting = now.runnable_since(self._last)
        # A window the forward spent mostly idle says nothing of its neighbours: a few ms of waiting would be a share.
        busy = runnable >= BUSY_CPUS * seconds * 1e9
        waiting_share = waiting / runnable if busy else 0.0
        idle_cpus, background_cpus = now.idle_cpus_since(self._last), now.background_cpus_since(self._last)
        self._last = now
        count = self._next_count(now.at, waiting_share, idle_cpus, background_cpus)
        if count != self.count:
            logger.info("CPU compute threads %d -> %d (threads waited %.0f%% of their runnable time; %.1f CPUs idle, "
                        "%.1f running the engine's background work)", self.count, count, 100 * waiting_share,
                        idle_cpus, background_cpus)
            self.count = count
            self._apply(count)
        return self.count

    def _next_count(self, at: float, waiting_share: float, idle_cpus: float, background_cpus: float) -> int:
        limit = self._limit()
        if self.count > limit:
            return limit
        # Waiting while a CPU stayed idle is the scheduler's placement (a thread woken beside another), not a lack of
        # CPUs: one thread fewer would not help. Waiting beside the engine's own background work is a lack of CPUs,
        # though (it stalls the barriers as any idle-priority task does): that step down stands, and the step up
        # below, which counts that work's CPU time as room, becomes a probe that backs off like any other.
        if self.count > 1 and waiting_share >= WAITING_SHARE_DOWN and idle_cpus < IDLE_CPUS_UP:
            self._hold = min(2 * self._hold, MAX_HOLD_S) if at - self._last_up < FLAP_S else HOLD_S
            self._no_up_before = at + self._hold
            return self.count - 1
        # The engine's background work is transient (a compile worker's imports, a build) and ours to outlast: the
        # forward takes its CPU back, or a CPU that only it kept busy would hold the count down for its whole run.
        if self.count < limit and idle_cpus + background_cpus >= IDLE_CPUS_UP and at >= self._no_up_before:
            self._last_up = at
            return self.count + 1
        return self.count


def compute_threads(config: EngineConfig, rank: int) -> ComputeThreads:
    """This rank's threads as configured: pinned to its cpu_threads_bind list, else cpu_threads (or OMP_NUM_THREADS)
    of them, else as many as the CPUs it may use allow."""
    if config.cpu_threads_bind is not None:
        cpus = cpu_lists(config.cpu_threads_bind)[rank]
        allowed = os.sched_getaffinity(0)
        if not set(cpus) <= allowed:
            raise ValueError(f"cpu_threads_bind: CPUs {sorted(set(cpus) - allowed)} are not among the CPUs this "
                             f"process may use ({sorted(allowed)})")
        return ComputeThreads(fixed=len(cpus), pin=lambda: _pin(cpus))
    fixed = config.cpu_threads or _omp_num_threads()
    return ComputeThreads(fixed=fixed)


def _pin(cpus: list[int]) -> None:
    module = cpu_extension.load()  # waits for a build under way: the pinning is the C++ kernels'
    if module is None:
        raise RuntimeError("cpu_threads_bind needs the C++ CPU kernels, which could not be built here")
    module.bind_threads(cpus)


def _omp_num_threads() -> int | None:
    """OMP_NUM_THREADS as a fixed count where it holds one positive number (Ray sets it to a rank's CPUs)."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None
