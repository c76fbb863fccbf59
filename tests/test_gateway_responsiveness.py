"""One client's huge bodies never stall the gateway for the others: /health answers and running streams flow while
9 MiB prompts are read, checked and refused."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from conftest import long_context_llama
from launcher import start_launcher, stop_launcher

NINE_MIB = "lorem ipsum dolor sit amet " * (9 * 2**20 // 27)
# Encoded once here: encoding 9 MiB of JSON in the client's own event loop would delay the /health reads it times.
HUGE_BODIES = [("/v1/completions", json.dumps({"prompt": NINE_MIB, "max_tokens": 2}).encode()),
               ("/v1/completions", json.dumps({"prompt": NINE_MIB, "max_tokens": 2}).encode()),
               ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": NINE_MIB}]}).encode())]


@pytest.fixture(scope="module")
def base_url():
    process, url = start_launcher(["--model", long_context_llama(), "--dtype", "float32", "--max-model-len", "4096",
                                   "--kv-cache-memory", "64MiB"])
    yield url
    stop_launcher(process)


def test_huge_bodies_leave_health_and_running_streams_responsive(base_url):
    async def scenario():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.aiter_lines()
                await anext(lines)  # the stream runs
                arrivals: list[float] = []

                async def read_stream():
                    async for line in lines:
                        arrivals.append(time.monotonic())

                reader = asyncio.create_task(read_stream())
                huge = [http.post(path, content=content, headers={"Content-Type": "application/json"})
                        for path, content in HUGE_BODIES]
                refusals = asyncio.gather(*huge)
                health_latencies = []
                while not refusals.done():
                    start = time.monotonic()
                    assert (await http.get("/health")).status_code == 200
                    health_latencies.append(time.monotonic() - start)
                    await asyncio.sleep(0.02)
                responses = await refusals
                await reader
                return responses, health_latencies, arrivals
    responses, health_latencies, arrivals = asyncio.run(scenario())
    assert all(r.status_code == 400 for r in responses), [r.text[:200] for r in responses]
    assert all(r.json()["error"]["param"] in ("prompt", "messages") for r in responses)
    assert health_latencies and max(health_latencies) < 0.5, health_latencies
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    assert len(arrivals) > 100 and max(gaps) < 0.5, max(gaps)
