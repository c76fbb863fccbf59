"""The serving benchmark's load generator: streamed OpenAI requests sent at a rate, each timed as its chunks arrive.

TTFT is the time to the first chunk carrying content, ITL the gaps between later such chunks (a chunk with several
tokens is one gap), E2E the time to `data: [DONE]`. Output tokens come from the `usage` the server reports when
asked with `stream_options.include_usage`, else from the tokenizer on the generated text, else one per content chunk.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httptools
import httpx
import msgspec
from tqdm import tqdm

from serve_dataset import RequestSpec, Tokenizer, count_tokens
from serve_report import compute_metrics
from sse_client import post_streamed

RESPONSE_TIMEOUT_S = 6 * 3600.0  # a loaded engine may take long to start and finish a request's stream
CONNECT_TIMEOUT_S = 60.0
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
CONTENT_FIELDS = ("text", "content", "reasoning_content", "reasoning")  # a completion's, a chat delta's


@dataclass
class RequestResult:
    """One request's measurements; times in seconds, send_time from the benchmark's start."""
    send_time: float = 0.0
    success: bool = False
    error: str = ""
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    output_tokens_from: str = ""  # "usage", "tokenizer" or "chunks"


@dataclass(frozen=True)
class Workload:
    """How every request of a run is asked for."""
    endpoint: str = "completions"
    ignore_eos: bool = True
    temperature: float = 0.0
    tokenizer: Tokenizer | None = None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def first_model(base_url: str, api_key: str | None) -> str:
    """The first model id that the server's `GET /v1/models` lists."""
    response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=auth_headers(api_key), timeout=CONNECT_TIMEOUT_S)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def request_body(model: str, spec: RequestSpec, workload: Workload) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "temperature": workload.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if workload.endpoint == "completions":
        return {**body, "prompt": spec.prompt}
    if not isinstance(spec.prompt, str):
        raise ValueError("the chat endpoint takes text prompts: random prompts need --tokenizer to become text")
    return {**body, "messages": [{"role": "user", "content": spec.prompt}]}


def chunk_content(choice: dict[str, Any]) -> str:
    source = choice.get("delta") or choice
    return "".join(value for name in CONTENT_FIELDS if isinstance(value := source.get(name), str))


def read_stream(events: list[tuple[float, bytes]], result: RequestResult, start: float, spec: RequestSpec,
                tokenizer: Tokenizer | None) -> None:
    """Fills `result` from a 200 response's events ((arrival perf_counter, `data:` payload)); `start` is the
    request's perf_counter send time."""
    content_times: list[float] = []
    pieces: list[str] = []
    first_choice_time: float | None = None
    usage: dict[str, int] | None = None
    done_time: float | None = None
    for arrival, payload in events:
        if payload == b"[DONE]":
            done_time = arrival
            break
        event = msgspec.json.decode(payload)
        if "error" in event:
            result.error = f"error event: {event['error']}"
            return
        if event.get("choices"):
            first_choice_time = first_choice_time or arrival
            if text := chunk_content(event["choices"][0]):
                content_times.append(arrival)
                pieces.append(text)
        if event.get("usage"):
            usage = event["usage"]
    result.e2e = (done_time if done_time is not None else time.perf_counter()) - start
    if done_time is None:
        result.error = "stream ended without data: [DONE]"
    elif first_choice_time is None:
        result.error = "no chunk with a choice"
    else:
        # A first token that decodes to no text yet still counts as the first token.
        result.ttft = (content_times[0] if content_times else first_choice_time) - start
        result.itl = [later - earlier for earlier, later in itertools.pairwise(content_times)]
        count_output(result, usage, "".join(pieces), len(content_times), spec, tokenizer)
        result.success = True


def count_output(result: RequestResult, usage: dict[str, int] | None, text: str, chunks: int, spec: RequestSpec,
                 tokenizer: Tokenizer | None) -> None:
    if usage and "completion_tokens" in usage:
        result.output_tokens, result.output_tokens_from = usage["completion_tokens"], "usage"
    elif tokenizer is not None:
        result.output_tokens, result.output_tokens_from = count_tokens(text, tokenizer), "tokenizer"
    else:
        result.output_tokens, result.output_tokens_from = chunks, "chunks"
    if usage and "prompt_tokens" in usage:
        result.prompt_tokens = usage["prompt_tokens"]
    else:
        result.prompt_tokens = spec.prompt_len or 0


async def send_request(url: str, headers: dict[str, str], body: bytes, spec: RequestSpec, bench_start: float,
                       tokenizer: Tokenizer | None) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(send_time=start - bench_start)
    try:
        response = await post_streamed(url, body, headers, CONNECT_TIMEOUT_S, RESPONSE_TIMEOUT_S)
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.body.decode(errors='replace')[:500]}"
        else:
            read_stream(response.events, result, start, spec, tokenizer)
    except (OSError, httptools.HttpParserError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if result.e2e is None:
        result.e2e = time.perf_counter() - start
    return result


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: all 0 for an infinite rate, else a Poisson process."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


async def run_benchmark(base_url: str, model: str, requests: list[RequestSpec], request_rate: float = math.inf,
                        *, api_key: str | None = None, max_concurrency: int | None = None, seed: int = 0,
                        workload: Workload = Workload(), progress: bool = False) -> dict[str, Any]:
    """Sends `requests` to the server at `base_url` and returns {"config", "metrics", "requests"}."""
    url = f"{base_url.rstrip('/')}{ENDPOINTS[workload.endpoint]}"
    headers = auth_headers(api_key)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    offsets = arrival_offsets(len(requests), request_rate, seed)
    bodies = [msgspec.json.encode(request_body(model, spec, workload)) for spec in requests]

    async def scheduled(body: bytes, spec: RequestSpec, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, bench_start + offset - time.perf_counter()))
        async with gate or contextlib.nullcontext():
            return await send_request(url, headers, body, spec, bench_start, workload.tokenizer)

    with tqdm(total=len(requests), disable=not progress) as bar:
        bench_start = time.perf_counter()
        tasks = [asyncio.create_task(scheduled(body, spec, offset))
                 for body, spec, offset in zip(bodies, requests, offsets)]
        for task in tasks:
            task.add_done_callback(lambda _: bar.update())
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - bench_start
    # JSON has no infinity: an all-at-once run's rate is written as the string "inf".
    config = {"base_url": base_url, "model": model, "endpoint": workload.endpoint, "num_prompts": len(requests),
              "request_rate": "inf" if math.isinf(request_rate) else request_rate,
              "max_concurrency": max_concurrency, "seed": seed, "ignore_eos": workload.ignore_eos,
              "temperature": workload.temperature}
    return {"config": config, "metrics": compute_metrics(results, duration),
            "requests": [asdict(r) for r in results]}
