"""The command line serves a model over HTTP: a given folder, or the built-in demo model when none is given."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from conftest import wait_until
from launcher import REPO, descendants, start_launcher, stop_launcher


def test_launch_without_model_serves_the_demo_model(tmp_path):
    """Started the way the issue writes it, `python launch/launch.py` (the other tests use `python -m launch`)."""
    process, base_url = start_launcher([], {"PAGEDSERVE_CACHE": str(tmp_path)}, as_script=True)
    try:
        assert (tmp_path / "demo-model" / "config.json").is_file()
        [model] = httpx.get(f"{base_url}/v1/models").json()["data"]
        completion = httpx.post(f"{base_url}/v1/completions", timeout=60,
                                json={"model": model["id"], "prompt": "Hello", "max_tokens": 5, "ignore_eos": True})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 5
    finally:
        assert stop_launcher(process) == 0


def test_launch_reports_bad_arguments(llama_model):
    result = subprocess.run([sys.executable, "-m", "launch", "--model", llama_model, "--tp", "0"], cwd=REPO,
                            env=os.environ, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "tensor_parallel_size" in result.stderr


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_operator_stop_after_an_engine_crash_exits_0(llama_model, stop_signal):
    """The gateways outlive a crashed engine core (503s by design); the operator's stop is still a clean one."""
    process, base_url = start_launcher(["--model", llama_model])
    try:
        children = descendants(process.pid)
        [engine_pid] = [pid for pid, command in children if "core.engine_process" in command]
        os.kill(engine_pid, signal.SIGKILL)
        assert wait_until(lambda: httpx.get(f"{base_url}/health").status_code == 503, timeout=10)
        process.send_signal(stop_signal)
        assert process.wait(timeout=60) == 0
        assert not [pid for pid, _ in children if os.path.exists(f"/proc/{pid}")]
    finally:
        stop_launcher(process)
