"""The forward's thread count with real threads and processes: the engine's own idle-priority work told apart from
its forward, and a real busy neighbour on a 2-CPU host."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_until

from kernels.thread_priority import lowest_priority
from workers.cpu_threads import read_schedule


def _work_then_idle(stop: threading.Event) -> None:
    while time.thread_time() < 0.1:  # CPU time that is background's once the thread is
        pass
    lowest_priority()
    stop.wait()


_WORK_THEN_IDLE = """import os, subprocess, sys, time
while time.process_time() < 0.3:
    pass
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # lowest_priority's, without importing torch
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # at idle priority, as a build's
print(child.pid, flush=True)
time.sleep(30)
"""


def test_readings_tell_the_engines_background_threads_and_processes_from_its_forward():
    """Idle-priority threads of this process and idle-priority processes it started (and theirs) are background:
    their CPU time is counted apart, their waiting not at all; a child at the engine's priority is not background."""
    stop = threading.Event()
    thread = threading.Thread(target=_work_then_idle, args=(stop,))
    thread.start()
    idle = subprocess.Popen([sys.executable, "-c", _WORK_THEN_IDLE], stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        grandchild = int(idle.stdout.readline())
        assert wait_until(lambda: thread.native_id in read_schedule().background_s, timeout=10)
        reading = read_schedule()
        assert reading.background_s[thread.native_id] >= 0.1 and thread.native_id not in reading.threads
        assert threading.get_native_id() in reading.threads and plain.pid not in reading.background_s
        assert reading.background_s[idle.pid] >= 0.25  # in clock ticks
        assert grandchild in reading.background_s and len(reading.background_s) == 3
    finally:
        stop.set()
        thread.join()
        for child in (idle, plain):
            child.kill()
            child.wait()
        with contextlib.suppress(NameError, ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)


_FORWARD_LOOP = """
import subprocess, sys, time, torch
from workers.cpu_threads import ComputeThreads
if sys.argv[1:] == ["background"]:  # a compile worker of its own, importing at idle priority all along
    subprocess.Popen([sys.executable, "-c", "import os\\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\\n"
                      "parent = os.getppid()\\nwhile os.getppid() == parent: pass"])  # ends with the loop
threads = ComputeThreads()
a = torch.randn(256, 256)
while sys.stdin.readline():  # a line from the test: one more window's work; the count afterwards
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        threads.adjust()
        a = torch.tanh(a @ a)
    print(threads.count, flush=True)
"""


class ForwardLoop:
    """A child process running a governed forward, a window's work at a time."""

    def __init__(self, *args: str) -> None:
        self.child = subprocess.Popen([sys.executable, "-c", _FORWARD_LOOP, *args], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])

    def count_within(self, expected: int, windows: int) -> list[int]:
        counts = []
        for _ in range(windows):
            self.child.stdin.write("\n")
            self.child.stdin.flush()
            counts.append(int(self.child.stdout.readline()))
            if counts[-1] == expected:
                break
        return counts

    def beside_a_busy_process(self) -> list[int]:
        """The counts until it drops to one thread beside a busy process (killed then)."""
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            return self.count_within(1, 10)
        finally:
            busy.kill()
            busy.wait()

    def close(self) -> None:
        self.child.kill()
        self.child.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the scenario is a 2-CPU host beside one busy process")
def test_a_real_busy_neighbour_on_two_cpus():
    """A forward of two threads on two CPUs: beside a busy process it drops to one thread within seconds, and takes
    the second back once the neighbour is gone."""
    forward = ForwardLoop()
    try:
        assert forward.count_within(2, 10)[-1] == 2
        assert (counts := forward.beside_a_busy_process())[-1] == 1, counts
        assert (counts := forward.count_within(2, 10))[-1] == 2, counts
    finally:
        forward.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the scenario is a 2-CPU host beside one busy process")
def test_a_real_neighbour_leaving_while_the_engines_own_background_work_runs():
    """The same with the forward's own idle-priority child spinning throughout (a compile worker importing): once
    the neighbour leaves, the CPU only that child keeps busy is taken back."""
    forward = ForwardLoop("background")
    try:
        assert (counts := forward.beside_a_busy_process())[-1] == 1, counts
        assert (counts := forward.count_within(2, 10))[-1] == 2, counts
    finally:
        forward.close()
