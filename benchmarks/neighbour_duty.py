"""Where one compute thread fewer starts to win: the engine at one thread, at two, and governed, beside a neighbour
that spins a share of the time.

The model maker's 30m llama, bf16, offline (`LLM.generate`, engine-core process), batch 1 (a 64-token prompt, 128
greedy tokens) and a batch of 32 (32 prompts of 64, 96 tokens each). Three engines up together, fixed at one thread
(--cpu-threads 1), fixed at two (--cpu-threads 2) and governed (workers/cpu_threads.py), take turns round by round
beside a neighbour that spins `duty` of every 5 ms and sleeps the rest (started and ended here, unpinned, nice 0):
output tokens per second of wall time, median of --repeats. Then, at two threads, the share of their runnable time
the forward's threads waited for a CPU (the governor's signal down, over its 0.2 s windows, median) and the CPUs that
others (the neighbour, our own front end) used. The governed engine should track the better fixed count at every
duty; docs/neighbours.md has the figures behind WAITING_SHARE_DOWN.

    python benchmarks/neighbour_duty.py [--duties 0 0.1 0.2 0.35 0.5 1] [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from neighbour import OUTPUTS, engine_run, model_dir  # noqa: E402

from frontend import LLM  # noqa: E402
from workers.cpu_threads import WINDOW_S, read_schedule  # noqa: E402

PERIOD_S = 0.005
SPIN = "import sys, time\nd, p = float(sys.argv[1]), float(sys.argv[2])\nwhile True:\n" \
       "    t = time.perf_counter()\n    while time.perf_counter() - t < d * p: pass\n    time.sleep((1 - d) * p)\n"


@contextlib.contextmanager
def spinning_neighbour(duty: float) -> Iterator[None]:
    """A process that spins `duty` of every PERIOD_S (none at 0)."""
    process = subprocess.Popen([sys.executable, "-c", SPIN, str(duty), str(PERIOD_S)]) if duty > 0 else None
    try:
        time.sleep(0.5)
        yield
    finally:
        if process is not None:
            process.kill()
            process.wait()


def engine_pid(before: set[int]) -> int:
    """The engine-core process this process started since `before` (its children then)."""
    return (children() - before).pop()


def children() -> set[int]:
    pids = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as listing:
            pids.update(int(pid) for pid in listing.read().split())
    return pids


def waiting_at_two(llm: LLM, pid: int, batch: int, windows: int = 10) -> tuple[float, float]:
    """(the forward's median waiting share, others' median CPUs) over `windows` windows while `llm` runs batches."""
    run, done = engine_run(llm, batch), threading.Event()

    def keep_running() -> None:
        while not done.is_set():
            run()
    runner = threading.Thread(target=keep_running)
    runner.start()
    try:
        time.sleep(0.5)
        shares, others = [], []
        last = read_schedule(str(pid))
        for _ in range(windows):
            time.sleep(WINDOW_S)
            now = read_schedule(str(pid))
            runnable, waiting = now.runnable_since(last)
            seconds = now.at - last.at
            shares.append(waiting / max(runnable, 1))
            others.append(len(now.idle_s) - now.idle_cpus_since(last) - (runnable - waiting) / 1e9 / seconds)
            last = now
        return statistics.median(shares), statistics.median(others)
    finally:
        done.set()
        runner.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duties", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.35, 0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    folder, engines, pids = str(model_dir("llama")), {}, {}
    for name, threads in (("1 thread", 1), ("2 threads", 2), ("governed", None)):
        before = children()
        engines[name] = LLM(folder, dtype="bfloat16", cpu_threads=threads)
        pids[name] = engine_pid(before)
    try:
        for batch in OUTPUTS:
            runs = {name: engine_run(llm, batch) for name, llm in engines.items()}
            for run in runs.values():
                run()
            for duty in args.duties:
                with spinning_neighbour(duty):
                    speeds = {name: [] for name in runs}
                    for _ in range(args.repeats):
                        for name, run in runs.items():
                            start = time.perf_counter()
                            speeds[name].append(run() / (time.perf_counter() - start))
                    share, others = waiting_at_two(engines["2 threads"], pids["2 threads"], batch)
                print(f"duty {duty:4.2f} batch {batch:2d}: " + " | ".join(
                    f"{name} {statistics.median(v):7.1f} tok/s" for name, v in speeds.items()) +
                    f" | at 2 threads the forward waited {share:.2f}, others used {others:.2f} CPUs", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
