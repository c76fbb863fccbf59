"""Start an engine-core process from a front end (or the launcher) and wait until it is ready.

The child is a fresh interpreter (`python -m core.engine_process`, never a fork), configured with msgspec
JSON on its command line. Two pipes link it to the parent: it reports start-up (ready, or the error) on one,
and it exits when the other closes, which happens when the parent exits or is killed: no orphans.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from core.kv_transfer import remove_region, transfer_group_configs
from ipc import EngineConfig, EngineInfo, EngineStartup
from ipc.lifeline import make_lifeline
from ipc.sockets import EngineEndpoints, remove_ipc_files

_START_TIMEOUT_S = float(os.environ.get("PAGEDSERVE_ENGINE_START_TIMEOUT", "600"))
_ERROR_TYPES = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "PermissionError": PermissionError}
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child `python -m ...` of ours: this checkout importable even when not installed."""
    path = os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


class EngineProcess:
    def __init__(self, config: EngineConfig, address: str, curve_key_file: str | None = None,
                 insecure_loopback: bool = False) -> None:
        self.endpoints = EngineEndpoints.from_address(address)
        status_read, status_write = os.pipe()
        watch_read, self._watch_write = make_lifeline()
        command = [sys.executable, "-m", "core.engine_process", "--config-json", msgspec.json.encode(config).decode(),
                   "--address", address, "--status-fd", str(status_write), "--parent-fd", str(watch_read)]
        if curve_key_file:
            command += ["--curve-key-file", str(curve_key_file)]
        if insecure_loopback:
            command.append("--insecure-loopback")
        env = child_env()
        try:
            # Its own session: a terminal's Ctrl-C goes to the front end or launcher, which stops it in order.
            self.process = subprocess.Popen(command, pass_fds=(status_write, watch_read), env=env,
                                            start_new_session=True)
        finally:
            os.close(status_write)
            os.close(watch_read)
        self._status = os.fdopen(status_read, "rb")
        self.info: EngineInfo | None = None  # once ready

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def wait_exit(self, timeout: float) -> bool:
        """True once the process has exited (waiting up to `timeout`)."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def wait_ready(self, timeout: float = _START_TIMEOUT_S) -> EngineInfo:
        """The engine's info once it listens; raises the engine's own start-up error (ValueError for bad config)."""
        try:
            status = self._read_status(timeout)
        except BaseException:
            self.shutdown()
            raise
        if status.info is None:
            self.shutdown()
            raise _ERROR_TYPES.get(status.error_type, RuntimeError)(status.error)
        self.info = status.info
        return status.info

    def _read_status(self, timeout: float) -> EngineStartup:
        deadline = time.monotonic() + timeout
        with self._status:
            while not select.select([self._status], [], [], 0.5)[0]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the engine core did not start within {timeout:.0f} s "
                                       "(PAGEDSERVE_ENGINE_START_TIMEOUT)")
            line = self._status.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"the engine core exited during start-up (exit code {self.process.returncode})")
        return msgspec.json.decode(line, type=EngineStartup)

    def end_group(self) -> None:
        """Once the engine has exited, kill what is left of its process group (its own session): a private Ray
        cluster's agents outlive an engine killed with SIGKILL, reparented to init, still in its group."""
        if not self.is_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def shutdown(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`, and what is left of its group; then its
        ipc:// socket files go."""
        if self.is_alive():
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.end_group()
        if self._watch_write is not None:
            os.close(self._watch_write)
            self._watch_write = None
        remove_ipc_files(self.endpoints)


def start_engines(configs: list[EngineConfig], addresses: list[str], curve_key_file: str | None = None,
                  insecure_loopback: bool = False) -> list[EngineProcess]:
    """Engine cores started side by side (data parallel), returned once every one is ready; if one fails to start,
    all are stopped and its error raised."""
    processes: list[EngineProcess] = []
    try:
        for config, address in zip(configs, addresses):
            processes.append(EngineProcess(config, address, curve_key_file, insecure_loopback))
        for process in processes:
            process.wait_ready()
    except BaseException:
        for process in processes:
            process.shutdown()
        raise
    finally:
        remove_region(configs)
    return processes


def data_parallel_configs(config: EngineConfig, cpus: list[int], first_rank: int = 0) -> list[EngineConfig]:
    """Each data-parallel engine's config: its rank; with enable_expert_parallel, where the engines' expert-parallel
    group meets (a free loopback port: the engines started here form one group); on a CPU a single-rank engine's
    threads pinned to its own equal share of `cpus` (engines whose threads all roam every CPU slow each other down),
    unless cpu_threads_bind or cpu_threads is given, there are more engines than CPUs, or the ranks are Ray actors
    (Ray places them). A kv_transfer_config group's engines get their roles (core/kv_transfer.py): these are the
    group's ranks first_rank.. (another machine's launcher starts the others)."""
    size = config.data_parallel_size
    shared = {}
    if config.enable_expert_parallel and size > 1:
        from workers.distributed import free_port  # torch: only where an engine group needs it

        shared["data_parallel_ep_address"] = f"127.0.0.1:{free_port('127.0.0.1')}"
    share = len(cpus) // size
    pin = not (config.cpu_threads_bind is not None or config.cpu_threads is not None or config.device == "cuda" or
               config.tensor_parallel_size * config.pipeline_parallel_size > 1 or share == 0 or
               config.data_parallel_backend == "ray")
    return transfer_group_configs([msgspec.structs.replace(
        config, data_parallel_rank=rank, **shared,
        **({"cpu_threads_bind": ",".join(map(str, cpus[rank * share:(rank + 1) * share]))} if pin else {}))
        for rank in range(size)], first_rank)
