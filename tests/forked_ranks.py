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
from collections.abc import Callable
from pathlib import Path

from workers.distributed import free_port
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
