"""Background work (kernel builds, grammar compiles) that runs only on CPU time the engine's threads leave idle."""
from __future__ import annotations

import os
import threading


def lowest_priority(thread_id: int | None = None) -> None:
    """The calling thread (or `thread_id`; Linux: the policy is per thread, and threads and processes it starts
    inherit it) runs only when a CPU would otherwise idle: SCHED_IDLE gives way at once when an engine thread wakes,
    while nice 19 still takes whole time slices, which stalls the forward's other threads at their barriers."""
    thread_id = threading.get_native_id() if thread_id is None else thread_id
    try:
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, thread_id, 19)
        except (AttributeError, OSError):
            pass


def whole_process_to_lowest_priority() -> None:
    """Every thread this process has now (libraries start their own), and so every one started later."""
    try:
        thread_ids = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:  # not Linux
        thread_ids = [threading.get_native_id()]
    for thread_id in thread_ids:
        lowest_priority(thread_id)
