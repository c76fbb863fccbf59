"""Data parallel over machines (--data-parallel-size-local, --headless, --data-parallel-remote), two launchers on
loopback standing in for two machines: one group of engine cores behind the first one's gateways."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from conftest import tiny_model, wait_until
from frontend import LLM, SamplingParams
from launch.dp_nodes import add_arguments, placement
from launcher import REPO, descendants, free_port, start_launcher, stop_launcher

PROMPTS = [[5 + i, 17, 300 + 7 * i, 9, 41] for i in range(6)]


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--engine-address")
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, size, message", [
    (["--data-parallel-size-local", "3"], 2, "between 1 and --dp"),
    (["--data-parallel-size-local", "1"], 2, "do not add up"),
    (["--data-parallel-size-local", "1", "--data-parallel-remote", "tcp://a:1,tcp://a:2"], 2, "do not add up"),
    (["--headless"], 2, "needs --data-parallel-address"),
    (["--headless", "--data-parallel-address", "h", "--data-parallel-remote", "tcp://a:1"], 2,
     "no --data-parallel-remote"),
    (["--engine-address", "tcp://h:1"], 2, "exposes one engine core"),
])
def test_placements_that_do_not_fit_are_refused_by_flag(argv, size, message):
    with pytest.raises(ValueError, match=message):
        placement(_flags(*argv), size)


def test_headless_engines_listen_on_consecutive_ports_and_the_head_attaches_them_after_its_own():
    headless = placement(_flags("--headless", "--data-parallel-size-local", "2", "--data-parallel-address", "10.0.0.2",
                                "--data-parallel-rpc-port", "6000"), 4)
    assert headless.headless and headless.local_addresses == ["tcp://10.0.0.2:6000", "tcp://10.0.0.2:6001"]
    head = placement(_flags("--data-parallel-size-local", "2", "--data-parallel-remote",
                            ",".join(headless.local_addresses)), 4)
    assert not head.headless and len(head.local_addresses) == 2 and head.remote_addresses == headless.local_addresses


def test_a_remote_engine_serves_as_one_of_the_group_and_its_death_fails_only_itself():
    single = LLM(tiny_model("llama"), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [single.tokenizer.decode(output.outputs[0].token_ids)
                for output in single.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    single.shutdown()
    port = free_port()
    common = [tiny_model("llama"), "--dtype", "float32", "--max-model-len", "256", "--dp", "2",
              "--data-parallel-size-local", "1", "--engine-insecure-loopback"]
    # The other "machine": its engine core alone, listening on loopback TCP.
    node = subprocess.Popen([sys.executable, "-m", "launch", *common, "--headless", "--data-parallel-address",
                             "127.0.0.1", "--data-parallel-rpc-port", str(port)], cwd=REPO)
    head, local, remote = None, [], []
    try:
        head, base_url = start_launcher([*common, "--data-parallel-remote", f"tcp://127.0.0.1:{port}",
                                         "--data-parallel-routing", "round_robin"])
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def completions() -> list[str]:
            return [client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text for prompt in PROMPTS]

        assert completions() == expected
        metrics = httpx.get(f"{base_url}/metrics").text
        assert all(f'engine_up{{engine="{engine}"' in metrics for engine in (0, 1))
        remote = [pid for pid, command in descendants(node.pid) if "core.engine_process" in command]
        local = [pid for pid, command in descendants(head.pid) if "core.engine_process" in command]
        assert len(remote) == 1 and len(local) == 1
        os.kill(remote[0], signal.SIGKILL)
        assert wait_until(lambda: httpx.get(f"{base_url}/health").status_code == 503, timeout=10)
        assert "engine core(s) 1 of 2 unavailable" in httpx.get(f"{base_url}/health").text
        assert completions() == expected  # the head's own engine takes every request now
        assert node.wait(10) == 1  # the headless launcher exits once its last engine core is gone
    finally:
        if head is not None:
            stop_launcher(head)
        stop_launcher(node)
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in local + remote), timeout=10)
