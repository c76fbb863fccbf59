"""/health tells the truth: 200 while the engine is alive and its loop advances, however busy; 503 when it is not."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from conftest import API_KEY, AUTH, wait_until
from frontend.core_client import HEARTBEAT_TIMEOUT_S, EngineCoreClient
from launcher import descendants, start_launcher, stop_launcher


def test_health_stays_200_under_500_concurrent_requests(server):
    async def scenario() -> tuple[list[int], list[int]]:
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
        # Each poll on a new connection, as a load balancer's probe does: a kept-alive one left idle past the server's
        # keep-alive timeout (a client starved of CPU among the busy processes) can be closed just as a poll reuses
        # it (HTTP's keep-alive race, not an unhealthy server).
        fresh = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server[1], headers=AUTH, timeout=120, limits=limits) as http, \
                httpx.AsyncClient(base_url=server[1], headers=AUTH, timeout=30, limits=fresh) as poller:
            # Long enough that the load outlasts several polls (sampled requests decode several steps per call).
            body = {"model": server_model(server), "prompt": "Hello there", "max_tokens": 128, "ignore_eos": True}
            load = asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(500)))
            polls = []
            while not load.done():
                polls.append((await poller.get("/health")).status_code)
                await asyncio.sleep(0.05)
            return [r.status_code for r in await load], polls
    statuses, polls = asyncio.run(scenario())
    assert statuses == [200] * 500
    assert len(polls) >= 5 and set(polls) == {200}


def test_health_is_503_once_the_engine_is_frozen(llama_model):
    """A frozen engine process (SIGSTOP) answers neither heartbeats nor ZMQ's pings: it counts as gone."""
    process, url = start_launcher(["--model", llama_model, "--dtype", "float32", "--max-model-len", "256"])
    [engine_pid] = [pid for pid, cmd in descendants(process.pid) if "core.engine_process" in cmd]
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        os.kill(engine_pid, signal.SIGSTOP)
        frozen_at, responses = time.monotonic(), []
        assert wait_until(lambda: responses.append(httpx.get(f"{url}/health")) or
                          responses[-1].status_code == 503, HEARTBEAT_TIMEOUT_S + 5)
        assert time.monotonic() - frozen_at <= HEARTBEAT_TIMEOUT_S + 5
        assert responses[-1].json()["error"]["message"] == "engine unavailable"  # no internals
    finally:
        os.kill(engine_pid, signal.SIGCONT)
        stop_launcher(process)


def test_a_stalled_loop_or_silent_engine_is_unhealthy(llama_model):
    client = EngineCoreClient.__new__(EngineCoreClient)  # only the heartbeat bookkeeping is exercised
    client.dead_reason = None
    client.last_heartbeat = (time.monotonic(), 0.3)
    assert client.health_problem(max_stall_s=60) is None
    client.last_heartbeat = (time.monotonic(), 61.0)  # the heartbeat says the loop is in a 61 s step
    assert "not advanced for 61 s" in client.health_problem(max_stall_s=60)
    client.last_heartbeat = (time.monotonic() - HEARTBEAT_TIMEOUT_S - 1, 0.0)
    assert "no heartbeat" in client.health_problem(max_stall_s=60)
    client.dead_reason = "gone"
    assert client.health_problem() == "gone"


def server_model(server) -> str:
    return httpx.get(f"{server[1]}/v1/models", headers=AUTH).json()["data"][0]["id"]


@pytest.mark.parametrize("path", ["/start_profile", "/stop_profile", "/reset_prefix_cache"])
def test_privileged_routes_are_absent_unless_the_engine_allows_them(server, path):
    assert httpx.post(f"{server[1]}{path}", headers=AUTH).status_code == 404


def test_privileged_routes_when_the_engine_allows_them(llama_model, tmp_path):
    process, url = start_launcher(["--model", llama_model, "--dtype", "float32", "--max-model-len", "256",
                                   "--api-key", API_KEY, "--profiler-dir", str(tmp_path), "--profiler-max-steps",
                                   "2", "--enable-cache-reset", "--max-choices-per-request", "3"])
    try:
        assert httpx.post(f"{url}/start_profile").status_code == 401
        assert httpx.post(f"{url}/start_profile", headers=AUTH).json() == {"result": str(tmp_path)}
        assert httpx.post(f"{url}/start_profile", headers=AUTH).status_code == 409  # already running
        body = {"model": llama_model, "prompt": "profile me", "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
        trace = httpx.post(f"{url}/stop_profile", headers=AUTH).json()["result"]
        assert os.path.dirname(trace) == str(tmp_path) and os.path.getsize(trace) > 0
        assert httpx.post(f"{url}/reset_prefix_cache", headers=AUTH).json() == {"result": True}
        too_many = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ["a", "b", "c", "d"]}, headers=AUTH)
        assert too_many.status_code == 400 and "limit of 3" in too_many.json()["error"]["message"]
    finally:
        stop_launcher(process)
