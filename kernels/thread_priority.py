"""Background work (kernel builds, grammar compiles) that runs only on CPU time the engine's threads leave idle."""
from __future__ import annotations

import os
import threading


def lowest_priority() -> None:
    """The calling thread (Linux: the policy is per thread; threads and processes it starts inherit it) runs only
    when a CPU would otherwise idle: SCHED_IDLE gives way at once when an engine thread wakes, while nice 19 still
    takes whole time slices, which stalls the forward's other threads at their barriers."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
