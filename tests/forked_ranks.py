"""TP ranks as processes forked from one driver (no Ray): a test runs a file as the driver, which forks the ranks
run after run and exits with the number of runs in which a rank failed, died of a signal or left files in /dev/shm."""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kernels import cpu_extension
from workers.distributed import free_port, init_distributed, shutdown_distributed
from workers.shm_communicator import SHM_DIR

HOST = "127.0.0.1"
_REPO_ROOT = Path(__file__).resolve().parents[1]

RankMain = Callable[[int, int, int, int], None]  # (rank, tp_size, port, run)


def run_driver(script: str, args: list[str], timeout: float) -> None:
    """`script` as a driver process given `args`; fails unless every run of it passed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen([sys.executable, script, *args], env=env, start_new_session=True,
                              stderr=subprocess.PIPE, text=True)
    try:
        _, errors = driver.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):  # ranks left blocked on a FIFO by a failed peer go too
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    assert driver.returncode == 0, f"{driver.returncode} runs failed:\n{errors[-4000:]}"


def run_kernel_driver(script: str, timeout: float) -> None:
    """run_driver of a script whose ranks call the C++ kernels: fails at once where the extension did not build."""
    if cpu_extension.load() is None:
        pytest.fail("the extension did not build")
    run_driver(script, [], timeout)


@contextlib.contextmanager
def kernel_rank(port: int, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> Iterator[None]:
    """A forked rank's CPU distributed state (one thread, no autograd) for the body, shut down after it."""
    torch.set_num_threads(1)
    init_distributed(HOST, port, tp_rank, tp_size, pp_rank, pp_size, torch.device("cpu"))
    try:
        with torch.inference_mode():
            yield
    finally:
        shutdown_distributed()


def drive(tp_size: int, repeats: int, rank_main: RankMain) -> int:
    """Fork tp_size ranks running rank_main `repeats` times, one run after another (forks skip importing torch
    again); the number of runs in which a rank failed, died of a signal or left files in /dev/shm."""
    gc.freeze()  # the ranks' exit, a third as long: their final collection skips what they inherit from here
    failed = 0
    for run in range(repeats):
        port = free_port(HOST)
        ranks = [_fork_rank(rank_main, rank, tp_size, port, run) for rank in range(tp_size)]
        exit_codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in ranks]
        left = [path for path in os.listdir(SHM_DIR) if path.startswith(f"pagedserve-{HOST}-{port}-")]
        if exit_codes != [0] * tp_size or left:
            print(f"run {run}: rank exit codes {exit_codes}, left in {SHM_DIR}: {left}", file=sys.stderr, flush=True)
            failed += 1
    return failed


def _fork_rank(rank_main: RankMain, rank: int, tp_size: int, port: int, run: int) -> int:
    pid = os.fork()
    if pid == 0:
        # Leave by SystemExit, not os._exit: the interpreter finalizes as it does in a real rank's exit.
        sys.exit(_rank_process(rank_main, rank, tp_size, port, run))
    return pid


def _rank_process(rank_main: RankMain, rank: int, tp_size: int, port: int, run: int) -> int:
    try:
        rank_main(rank, tp_size, port, run)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0
