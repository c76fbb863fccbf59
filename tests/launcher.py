"""Start `python -m launch` for a test and find its processes."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_launcher(args: list[str], env_extra: dict[str, str] | None = None, timeout: float = 180.0,
                   as_script: bool = False) -> tuple[subprocess.Popen, str]:
    """The launcher process (`python -m launch`, or `python launch/launch.py` as_script) and its base URL, once
    /health answers 200."""
    port = free_port()
    env = {**os.environ, **(env_extra or {})}
    entry = ["launch/launch.py"] if as_script else ["-m", "launch"]
    process = subprocess.Popen([sys.executable, *entry, "--port", str(port), *args], cwd=REPO, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the launcher exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return process, base_url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise TimeoutError("the launcher did not become healthy")


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            try:
                command = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            found.append((child, command))
            stack.append(child)
    return found


def engine_pid(launcher_pid: int) -> int:
    """The pid of the one engine-core process below a launcher."""
    [pid] = [pid for pid, command in descendants(launcher_pid) if "core.engine_process" in command]
    return pid


def stop_launcher(process: subprocess.Popen, timeout: float = 60.0) -> int:
    if process.poll() is None:
        process.terminate()
    return process.wait(timeout)


def running(pid: int) -> bool:
    """The process exists and is not a zombie (one killed with its parent waits for init to reap it)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def throttled(pid: int, share: float = 0.1, period: float = 0.05):
    """Run process `pid` a `share` of each `period` (SIGSTOP/SIGCONT), so a test can see work in flight that a fast
    machine would finish between two polls; the process runs freely again on exit."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGCONT)
            time.sleep(share * period)
            os.kill(pid, signal.SIGSTOP)
            done.wait((1 - share) * period)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        os.kill(pid, signal.SIGCONT)
