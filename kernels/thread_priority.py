"""Background work (kernel builds, grammar compiles) that runs only on CPU time the engine's threads leave idle."""
from __future__ import annotations

import os
import threading


def lowest_priority(thread_id: int | None = None) -> None:
    """The calling thread (or `thread_id`; Linux: the policy is per thread, and threads and processes it starts
    inherit it) runs only when a CPU would otherwise idle: SCHED_IDLE gives way when an engine thread wakes, while
    nice 19 still takes whole time slices. Neither makes it harmless to the forward's barriers: it still takes the
    CPU each time a forward thread sleeps for a moment (docs/neighbours.md), so the thread count counts such time as
    spare only where it is the engine's own (runs_in_background), transient work."""
    thread_id = threading.get_native_id() if thread_id is None else thread_id
    try:
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, thread_id, 19)
        except (AttributeError, OSError):
            pass


def runs_in_background(task_id: int) -> bool:
    """Whether a thread (or a process: its main thread) runs as lowest_priority() leaves it while the calling thread
    does not: background work of ours, where the caller is an engine thread (an engine started whole at idle
    priority has no background to tell apart). False for a task that has ended."""
    idle = getattr(os, "SCHED_IDLE", None)
    try:
        return idle is not None and os.sched_getscheduler(task_id) == idle != os.sched_getscheduler(0)
    except OSError:
        return False
