"""Background work (kernel builds, grammar compiles) that runs only on CPU time the engine's threads leave idle."""
from __future__ import annotations

import contextlib
import os
import threading


def lowest_priority(thread_id: int | None = None) -> None:
    """The calling thread (or `thread_id`; Linux: the policy is per thread, and threads and processes it starts
    inherit it) runs only when a CPU would otherwise idle: SCHED_IDLE gives way at once when an engine thread wakes,
    while nice 19 alone still takes whole time slices, which stalls the forward's other threads at their barriers.
    Nice 19 too, so that the kernel counts its CPU time as niced: the engine's thread count reads that time as
    spare (workers/cpu_threads.py)."""
    thread_id = threading.get_native_id() if thread_id is None else thread_id
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, thread_id, 19)
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
