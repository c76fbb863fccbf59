"""An external `ray start --head` cluster with token authentication, on loopback: `--tp 2 --ray-address` with the token
serves through it, greedy output equal to one rank's; without the right token, or with nothing listening, the
launcher fails within seconds and says what to set."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

# Ray turns a 127.0.0.1 cluster address into this machine's outward IP unless told that the machine's IP is
# loopback (read when ray is imported, inherited by the launcher and Ray processes): all of it stays on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from conftest import wait_until  # noqa: E402
from frontend import LLM, SamplingParams  # noqa: E402
from launcher import REPO, descendants, free_port, start_launcher, stop_launcher  # noqa: E402

RAY = Path(sys.executable).with_name("ray")
PROMPTS = ["Hello, my name is", "The capital of France is"]
MAX_TOKENS = 10
AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# Python, torch and the engine process start in this time too; before the fix a refused token took 20 s of retries
# inside ray.init and nothing listening took minutes.
FAILS_WITHIN_S = 30.0


@dataclass(frozen=True)
class TokenCluster:
    address: str
    token_file: Path
    head_pid: int


@pytest.fixture(scope="module")
def token_cluster() -> Iterator[TokenCluster]:
    """A one-node cluster of 2 CPUs on 127.0.0.1 that requires a fresh token. The token and Ray's files live in a
    temp dir (RAY_AUTH_TOKEN_PATH), not in ~/.ray; `ray start --block` takes its node down on SIGTERM, so no
    `ray stop`, which would stop every Ray cluster of this user on the machine."""
    root = Path(tempfile.mkdtemp(prefix="psray-"))  # short: Ray's socket paths under it must fit in 107 bytes
    token_file = root / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    command = [str(RAY), "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
               "--num-cpus", "2", "--include-dashboard=false", "--dashboard-port", str(free_port()),
               "--dashboard-agent-listen-port", str(free_port()), "--disable-usage-stats",
               "--temp-dir", str(root / "ray")]
    with open(root / "head.log", "wb") as log:
        head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # `ray start` writes the address file once the head node is up.
        up = wait_until(lambda: (root / "ray" / "ray_current_cluster").exists() or head.poll() is not None, 120)
        assert up and head.poll() is None, (root / "head.log").read_text()[-3000:]
        yield TokenCluster(f"127.0.0.1:{port}", token_file, head.pid)
    finally:
        _stop_head(head)
        shutil.rmtree(root, ignore_errors=True)


def _stop_head(head: subprocess.Popen) -> None:
    head.terminate()
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()


def test_tp2_serves_through_a_token_cluster(token_cluster: TokenCluster, llama_model: str) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    single_rank = LLM(llama_model, dtype="float32", in_process=True)
    try:
        expected = [output.outputs[0].text for output in single_rank.generate(PROMPTS, greedy, use_tqdm=False)]
    finally:
        single_rank.shutdown()
    token_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_cluster.token_file)}
    process, base_url = start_launcher(["--model", llama_model, "--dtype", "float32", "--tp", "2",
                                        "--ray-address", token_cluster.address], token_env)
    try:
        assert len(_rank_workers(token_cluster.head_pid)) == 2, "the ranks should run on the external cluster"
        for prompt, text in zip(PROMPTS, expected):
            completion = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
                "model": llama_model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == text
    finally:
        assert stop_launcher(process) == 0
    assert wait_until(lambda: not _rank_workers(token_cluster.head_pid), timeout=30), "the ranks should be released"


@pytest.mark.parametrize("case", ["no_token", "wrong_token", "nothing_listening"])
def test_a_refused_ray_address_fails_within_seconds(token_cluster: TokenCluster, llama_model: str, case: str) -> None:
    env = {name: value for name, value in os.environ.items() if name not in AUTH_VARIABLES}
    address = token_cluster.address
    if case == "wrong_token":
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    elif case == "nothing_listening":
        address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "launch", "--model", llama_model, "--tp", "2", "--ray-address",
                             address, "--port", str(free_port())], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    assert elapsed < FAILS_WITHIN_S
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if case == "nothing_listening":
        assert f"nothing answers at {address}" in error
    else:
        assert f"cannot authenticate to the Ray cluster at {address}" in error
        assert all(name in error for name in ("RAY_AUTH_MODE=token", "~/.ray/auth_token", "RAY_AUTH_TOKEN_PATH"))


def _rank_workers(head_pid: int) -> list[int]:
    """Processes under the head node whose title Ray set to a RankWorker actor's."""
    return [pid for pid, command in descendants(head_pid) if command.startswith("ray::RankWorker")]
