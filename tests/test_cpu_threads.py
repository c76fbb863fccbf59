"""The forward's thread count: follows the usable CPUs, steps down beside a busy neighbour and back up after it."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ipc import EngineConfig
from ipc.config import cpu_lists
from workers import cpu_threads
from workers.cpu_limits import cgroup_cpu_quota, usable_cpus
from workers.cpu_threads import ComputeThreads, Reading, read_schedule


class Machine:
    """Scripted readings: each window, how much the threads waited, how many CPUs idled and how many the engine's
    background work (a compile worker) took."""

    def __init__(self, cpus: int = 2) -> None:
        self.cpus, self.at, self.running, self.waiting, self.idle = cpus, 0.0, 0, 0, {cpu: 0.0 for cpu in range(cpus)}
        self.background, self.reads = 0.0, 0
        self.applied: list[int] = []

    def read(self) -> Reading:
        self.reads += 1
        return Reading(self.at, {1: (self.running, self.waiting)}, dict(self.idle), {2: self.background})

    def window(self, threads: ComputeThreads, waiting_share: float, idle_cpus: float, seconds: float = 0.25,
               background_cpus: float = 0.0) -> int:
        runnable = int(seconds * 1e9 * threads.count)
        self.at += seconds
        self.waiting += int(runnable * waiting_share)
        self.running += runnable - int(runnable * waiting_share)
        for cpu in self.idle:
            self.idle[cpu] += idle_cpus * seconds / len(self.idle)
        self.background += background_cpus * seconds
        return threads.adjust()


def governed(machine: Machine, fixed: int | None = None) -> ComputeThreads:
    threads = ComputeThreads(fixed=fixed, read=machine.read, limit=lambda: machine.cpus, apply=machine.applied.append,
                             clock=lambda: machine.at)
    threads.adjust()
    return threads


def test_a_busy_neighbour_takes_one_thread_and_gives_it_back_when_it_leaves():
    machine = Machine()
    threads = governed(machine)
    assert threads.count == 2 and machine.applied == [2]
    assert machine.window(threads, waiting_share=0.02, idle_cpus=0.0) == 2  # our own front end, briefly
    assert machine.window(threads, waiting_share=0.33, idle_cpus=0.0) == 1
    for _ in range(10):  # the neighbour stays: no CPU idles beside the one thread
        assert machine.window(threads, waiting_share=0.0, idle_cpus=0.05) == 1
    assert machine.window(threads, waiting_share=0.0, idle_cpus=0.95) == 2
    assert machine.applied == [2, 1, 2]


def test_a_neighbour_that_comes_and_goes_is_probed_ever_more_rarely():
    machine = Machine()
    threads = governed(machine)
    ups = []
    for window in range(400):  # 100 s: idle CPUs at one thread, contention at two
        if threads.count == 1:
            machine.window(threads, waiting_share=0.0, idle_cpus=0.9)
        else:
            machine.window(threads, waiting_share=0.3, idle_cpus=0.0)
        if threads.count == 2:
            ups.append(machine.at)
    gaps = [b - a for a, b in zip(ups, ups[1:])]
    assert gaps == sorted(gaps) and max(gaps) >= cpu_threads.MAX_HOLD_S  # backs off up to the longest hold
    assert len(ups) < 20


def test_a_cpu_only_the_engines_background_work_keeps_busy_is_room_for_a_thread():
    """A compile worker importing at idle priority on the CPU the forward left: no neighbour's, so the forward takes
    it back after the hold, at one thread as at any count."""
    machine = Machine()
    threads = governed(machine)
    assert machine.window(threads, waiting_share=0.33, idle_cpus=0.0) == 1  # a real neighbour, then it leaves
    counts = [machine.window(threads, waiting_share=0.0, idle_cpus=0.05, background_cpus=0.9) for _ in range(4)]
    assert counts == [1, 2, 2, 2]  # up once the hold (two windows) is over, though no CPU idled
    machine.idle = {cpu: 0.0 for cpu in machine.idle}  # a foreign idle-priority task stays a neighbour
    threads = governed(machine)
    assert machine.window(threads, waiting_share=0.33, idle_cpus=0.0) == 1
    assert [machine.window(threads, waiting_share=0.0, idle_cpus=0.05) for _ in range(4)] == [1] * 4


def test_waiting_beside_the_engines_background_work_still_steps_down_and_backs_off():
    """Where the forward's threads do wait beside it (it stalls barriers as any idle-priority task can), the count
    steps down, and the probes back up grow rarer as for a neighbour that comes and goes."""
    machine = Machine()
    threads = governed(machine)
    ups = []
    for _ in range(200):  # 50 s of a build at idle priority
        share = 0.3 if threads.count == 2 else 0.0
        machine.window(threads, waiting_share=share, idle_cpus=0.0, background_cpus=1.0 if threads.count == 1 else 0.2)
        ups += [machine.at] if threads.count == 2 else []
    assert 3 <= len(ups) < 15 and max(b - a for a, b in zip(ups, ups[1:])) >= cpu_threads.MAX_HOLD_S


def test_windows_shorter_than_the_window_change_nothing():
    machine = Machine()
    threads = governed(machine)
    assert machine.window(threads, waiting_share=0.9, idle_cpus=0.0, seconds=cpu_threads.WINDOW_S / 3) == 2


def test_steps_within_a_window_read_no_counters():
    machine = Machine()
    threads = governed(machine)
    reads = machine.reads
    for _ in range(50):  # steps of a millisecond
        machine.at += 0.001
        threads.adjust()
    assert machine.reads == reads
    machine.window(threads, waiting_share=0.0, idle_cpus=0.0)
    assert machine.reads == reads + 1


def test_waiting_beside_a_idle_cpu_or_in_an_idle_window_keeps_the_count():
    machine = Machine()
    threads = governed(machine)
    assert machine.window(threads, waiting_share=0.3, idle_cpus=0.9) == 2  # placement, not a lack of CPUs
    machine.at += 5.0  # no steps for 5 s, then a window with a little work that waited
    assert machine.window(threads, waiting_share=0.5, idle_cpus=0.0, seconds=0.2) == 2


def test_the_count_follows_the_usable_cpus_at_once():
    machine = Machine(cpus=4)
    threads = governed(machine)
    assert threads.count == 4
    machine.cpus = 1  # taskset -p, or a tighter cgroup quota, while it runs
    assert machine.window(threads, waiting_share=0.0, idle_cpus=3.0) == 1
    machine.cpus = 2
    assert machine.window(threads, waiting_share=0.0, idle_cpus=1.5) == 2
    assert machine.window(threads, waiting_share=0.0, idle_cpus=1.5) == 2  # never past the limit


def test_idle_time_is_summed_over_the_cpus_both_readings_counted():
    """A changed mask (taskset -p while it runs) neither invents nor loses idle CPUs."""
    wide = Reading(10.0, {}, {0: 100.0, 1: 200.0})
    narrow = Reading(11.0, {}, {0: 100.5})
    assert narrow.idle_cpus_since(wide) == 0.5
    assert Reading(12.0, {}, {0: 101.0, 1: 250.0}).idle_cpus_since(narrow) == 0.5


def test_threads_that_end_or_start_between_readings_are_not_counted():
    """A thread gone since the last reading took its counters with it: only threads both readings saw count."""
    earlier = Reading(0.0, {1: (10**8, 5 * 10**7), 2: (10**9, 10**9)}, {})
    later = Reading(1.0, {1: (3 * 10**8, 1.5 * 10**8), 3: (10**9, 10**9)}, {})
    assert later.runnable_since(earlier) == (3 * 10**8, 10**8)


def test_only_the_forwards_threads_waiting_counts():
    """The forward's two threads runnable all of a window (8% of it waiting: our front end's moments) beside helper
    threads that ran for moments and waited behind them: the helpers' waiting is the team's doing, not a neighbour's,
    and counted with the forward's it would pass WAITING_SHARE_DOWN."""
    earlier = Reading(0.0, {1: (0, 0), 2: (0, 0), 3: (0, 0), 4: (0, 0)}, {0: 0.0, 1: 0.0})
    window = cpu_threads.WINDOW_S
    forward, helper = (int(0.92 * window * 1e9), int(0.08 * window * 1e9)), (int(0.01 * window * 1e9),
                                                                             int(0.2 * window * 1e9))
    later = Reading(window, {1: forward, 2: forward, 3: helper, 4: helper}, {0: 0.0, 1: 0.0})
    runnable, waiting = later.runnable_since(earlier)
    assert runnable == 2 * sum(forward) and waiting == 2 * forward[1]
    machine = Machine()
    threads = ComputeThreads(read=iter([earlier, later]).__next__, limit=lambda: 2, apply=machine.applied.append,
                             clock=lambda: window)
    assert threads.adjust() == 2 and machine.applied == [2]
    everything = sum(map(sum, later.threads.values()))
    assert (forward[1] * 2 + helper[1] * 2) / everything >= cpu_threads.WAITING_SHARE_DOWN  # what it counted before


def test_a_fixed_count_never_moves():
    machine = Machine()
    threads = governed(machine, fixed=3)
    for _ in range(5):
        assert machine.window(threads, waiting_share=0.5, idle_cpus=0.0) == 3
    assert machine.applied == [3]


def test_the_count_is_set_again_on_each_new_forward_thread():
    """OpenMP's thread count belongs to the thread that set it."""
    machine = Machine()
    threads = governed(machine)
    worker = threading.Thread(target=threads.adjust)
    worker.start()
    worker.join()
    assert machine.applied == [2, 2]


def test_cgroup_quotas_v2_and_v1(tmp_path: Path):
    (tmp_path / "outer" / "inner").mkdir(parents=True)
    (tmp_path / "outer" / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "outer" / "inner" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/outer/inner\n") == 2.5  # the tightest of the ancestors
    (tmp_path / "outer" / "inner" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/outer/inner\n") == 1.5
    assert cgroup_cpu_quota(tmp_path, "0::/elsewhere\n") is None
    v1 = tmp_path / "cpu,cpuacct" / "pod"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path, "4:cpu,cpuacct:/pod\n3:memory:/pod\n") == 0.5
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path, "4:cpu,cpuacct:/pod\n") is None


def test_usable_cpus_follow_the_affinity_mask():
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert 1 <= usable_cpus() <= len(before)


def test_readings_count_this_process_and_its_cpus():
    first = read_schedule()
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:
        pass
    second = read_schedule()
    runnable, waiting = second.runnable_since(first)
    assert runnable >= 0.25e9  # this thread was runnable throughout, running or waiting for a CPU
    assert 0 <= waiting <= runnable and second.idle_cpus_since(first) >= 0


@pytest.mark.parametrize("text, error", [("0-1|2", "one CPU list per rank"), ("1-0", "not a CPU list"),
                                         ("0,2048", "below 1024"), ("a", "not a CPU list")])
def test_bad_bind_lists_are_refused(text, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(model="m", cpu_threads_bind=text)


def test_bind_lists_per_rank():
    assert cpu_lists("0-2,5|3,4") == [[0, 1, 2, 5], [3, 4]]
    EngineConfig(model="m", cpu_threads_bind="0-1|2-3", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="overlap"):
        EngineConfig(model="m", cpu_threads_bind="0-1|1-2", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cpu_threads must equal"):
        EngineConfig(model="m", cpu_threads_bind="0-1", cpu_threads=3)


def test_binding_pins_each_thread_of_the_team():
    """In a child process: the pinned team's threads each allow exactly their CPU."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    code = ("import os, torch; from ipc import EngineConfig; from workers.cpu_threads import compute_threads\n"
            f"t = compute_threads(EngineConfig(model='m', cpu_threads_bind={','.join(map(str, cpus))!r}), 0)\n"
            "t.adjust()\n"
            "masks = sorted(tuple(sorted(os.sched_getaffinity(int(task)))) for task in os.listdir('/proc/self/task'))\n"
            "print(torch.get_num_threads(), masks)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    count, masks = out.stdout.strip().split(" ", 1)
    assert int(count) == len(cpus)
    for cpu in cpus:
        assert f"({cpu},)" in masks


def test_binding_outside_the_allowed_cpus_is_refused():
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"CPUs \\[{outside}\\] are not among"):
        cpu_threads.compute_threads(EngineConfig(model="m", cpu_threads_bind=str(outside)), 0)


def test_the_launchers_flags_reach_the_engine_config():
    from launch.launch import build_parser, engine_config

    config = engine_config(build_parser().parse_args(["--cpu-threads", "3", "--cpu-threads-bind", "0-2"]), "unused")
    assert config.cpu_threads == 3 and config.cpu_threads_bind == "0-2"
    defaults = engine_config(build_parser().parse_args([]), "unused")
    assert defaults.cpu_threads is None and defaults.cpu_threads_bind is None


def test_an_engine_runs_the_count_it_is_given(llama_model):
    """An in-process engine (this process's torch threads are its own): its steps run at the fixed count."""
    from frontend import LLM, SamplingParams

    before = torch.get_num_threads()
    llm = LLM(llama_model, in_process=True, dtype="float32", max_model_len=128, num_kv_blocks=16, cpu_threads=1)
    try:
        outputs = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        assert len(outputs[0].outputs[0].token_ids) == 4
        assert llm.client.engine.executor.worker.threads.count == 1 and torch.get_num_threads() == 1
    finally:
        llm.shutdown()
        torch.set_num_threads(before)
