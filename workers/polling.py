"""Bounded polling before a blocking wait: a waiter that expects its event within microseconds keeps its CPU."""
from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def poll_budget_ns(spin_us: int, num_pollers: int) -> int:
    """How long each of num_pollers processes may poll, in ns: none when they outnumber this process's CPUs,
    since then a poller holds a CPU that the process it waits for needs."""
    return spin_us * 1000 if len(os.sched_getaffinity(0)) >= num_pollers else 0


def poll(attempt: Callable[[], T], budget_ns: int) -> T | None:
    """attempt()'s first truthy result, trying until budget_ns has passed (yielding the CPU between tries); None
    if the budget ran out first."""
    deadline = time.perf_counter_ns() + budget_ns
    while not (result := attempt()):
        if time.perf_counter_ns() >= deadline:
            return None
        os.sched_yield()
    return result
