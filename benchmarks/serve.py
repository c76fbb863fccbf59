"""Serving benchmark against a running OpenAI-compatible gateway, in the manner of `vllm bench serve`.

Sends --num-prompts streaming `POST /v1/completions` requests made of random token ids (--input-len ids from
[3, --vocab), --output-len tokens each with ignore_eos, greedy), either all at once (--request-rate inf) or as
a seeded Poisson process of --request-rate requests/s, optionally capped at --max-concurrency in flight. Per
request it measures TTFT (first chunk carrying text), every inter-token latency (between successive chunks
carrying text; a chunk with several tokens counts as one gap), end-to-end latency and output tokens (from the
`usage` chunk that `stream_options.include_usage` asks for). Prints request and token throughput and mean /
p50 / p99 of TTFT, TPOT ((e2e - ttft) / (output tokens - 1)), ITL and E2E in ms; --json writes them with every
request's measurements, --plot draws each request's TTFT and E2E latency against its send time.

--compare-offline needs no running server (issue 4's benchmark). On --model-path (default: the benchmark model) it
keeps an offline `LLM` and a launched server (`python -m launch` on a free loopback port, same engine settings)
up side by side and warms both with every request cut to a few tokens. Then, --rounds times, it runs the
requests through offline `LLM.generate` (greedy, ignore_eos) and sends them all at once to the server
(saturation). Target: output tokens/s through HTTP >= 90% of offline, as the median of the rounds' ratios (this
machine's speed drifts by more than 10% between runs, so one run misleads). It then sends the requests as a
Poisson process at half the median saturation request throughput (TTFT and TPOT there) and stops the launcher
with SIGTERM. Prompt ids come from the model's vocabulary unless --vocab is given; --plot draws the half-rate
run; the exit status is 1 on a failed request or a launcher exit other than 0.

The core is importable: `make_requests` builds the workload, `run_benchmark` runs it and returns the results.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httptools
import httpx
import msgspec
import numpy as np
import uvloop
from tqdm import tqdm

from sse_client import post_streamed

RESPONSE_TIMEOUT_S = 6 * 3600.0  # a loaded engine may take long to start and finish a request's stream
CONNECT_TIMEOUT_S = 60.0
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
DEFAULT_VOCAB = 8192
DEFAULT_MAX_WAITING_REQUESTS = 1024  # the launcher's
WARM_UP_OUTPUT_LEN = 16  # --compare-offline: every request, this short, untimed on each side first
HTTP_OFFLINE_TARGET = 0.90  # issue 4: all-at-once output tokens/s through HTTP over offline LLM.generate


@dataclass
class RequestSpec:
    prompt: list[int]
    output_len: int


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


def make_requests(num_prompts: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    # Ids from 3 up: the model maker's tokenizers keeps 0-2 for special tokens.
    return [RequestSpec([rng.randrange(3, vocab) for _ in range(input_len)], output_len) for _ in range(num_prompts)]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def first_model(base_url: str, api_key: str | None) -> str:
    """The first model id that the gateway's `GET /v1/models` lists."""
    response = httpx.get(f"{base_url}/v1/models", headers=auth_headers(api_key), timeout=CONNECT_TIMEOUT_S)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def completion_body(model: str, spec: RequestSpec) -> dict[str, Any]:
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def read_stream(events: list[tuple[float, bytes]], result: RequestResult, start: float) -> None:
    """Fills `result` from a 200 response's events ((arrival perf_counter, `data:` payload)); `start` is the
    request's perf_counter send time."""
    text_times: list[float] = []
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
            if event["choices"][0].get("text"):
                text_times.append(arrival)
        if event.get("usage"):
            usage = event["usage"]
    result.e2e = (done_time if done_time is not None else time.perf_counter()) - start
    if done_time is None:
        result.error = "stream ended without data: [DONE]"
    elif usage is None:
        result.error = "no usage chunk (stream_options.include_usage)"
    elif first_choice_time is None:
        result.error = "no chunk with a choice"
    else:
        # A first token that decodes to no text yet still counts as the first token.
        result.ttft = (text_times[0] if text_times else first_choice_time) - start
        result.itl = [later - earlier for earlier, later in zip(text_times, text_times[1:])]
        result.prompt_tokens = usage["prompt_tokens"]
        result.output_tokens = usage["completion_tokens"]
        result.success = True


async def send_request(url: str, headers: dict[str, str], body: bytes, bench_start: float) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(send_time=start - bench_start)
    try:
        response = await post_streamed(url, body, headers, CONNECT_TIMEOUT_S, RESPONSE_TIMEOUT_S)
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.body.decode(errors='replace')[:500]}"
        else:
            read_stream(response.events, result, start)
    except (OSError, httptools.HttpParserError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if result.e2e is None:
        result.e2e = time.perf_counter() - start
    return result


async def scheduled_request(url: str, headers: dict[str, str], body: bytes, bench_start: float, offset: float,
                            gate: asyncio.Semaphore | None) -> RequestResult:
    """Waits until `offset` seconds after `bench_start` and for a free slot under `gate`, then sends."""
    await asyncio.sleep(max(0.0, bench_start + offset - time.perf_counter()))
    async with gate or contextlib.nullcontext():
        return await send_request(url, headers, body, bench_start)


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
                        progress: bool = False) -> dict[str, Any]:
    """Sends `requests` to the gateway at `base_url` and returns {"config", "metrics", "requests"}."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    headers = auth_headers(api_key)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    offsets = arrival_offsets(len(requests), request_rate, seed)
    bodies = [msgspec.json.encode(completion_body(model, spec)) for spec in requests]
    with tqdm(total=len(requests), disable=not progress) as bar:
        bench_start = time.perf_counter()
        tasks = [asyncio.create_task(scheduled_request(url, headers, body, bench_start, offset, gate))
                 for body, offset in zip(bodies, offsets)]
        for task in tasks:
            task.add_done_callback(lambda _: bar.update())
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - bench_start
    # JSON has no infinity: an all-at-once run's rate is written as the string "inf".
    config = {"base_url": base_url, "model": model, "num_prompts": len(requests),
              "request_rate": "inf" if math.isinf(request_rate) else request_rate,
              "max_concurrency": max_concurrency, "seed": seed}
    return {"config": config, "metrics": compute_metrics(results, duration),
            "requests": [asdict(r) for r in results]}


def summarize(values_s: list[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 in milliseconds of values in seconds (None when there are none)."""
    if not values_s:
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
    ms = np.asarray(values_s) * 1000.0
    return {"mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99))}


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    latencies = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    errors = Counter(r.error for r in results if not r.success)
    return {"duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
            "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
            "request_throughput": len(ok) / duration,
            "output_token_throughput": output_tokens / duration,
            "total_token_throughput": (input_tokens + output_tokens) / duration,
            **{name: summarize(values) for name, values in latencies.items()},
            "errors": dict(errors.most_common())}


def row(label: str, value: Any) -> str:
    shown = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{shown:>12}"


def format_report(metrics: dict[str, Any]) -> str:
    lines = ["{:=^52}".format(" Serving Benchmark Result "),
             row("Successful requests:", metrics["completed"]),
             row("Failed requests:", metrics["failed"]),
             row("Benchmark duration (s):", metrics["duration_s"]),
             row("Total input tokens:", metrics["total_input_tokens"]),
             row("Total generated tokens:", metrics["total_output_tokens"]),
             row("Request throughput (req/s):", metrics["request_throughput"]),
             row("Output token throughput (tok/s):", metrics["output_token_throughput"]),
             row("Total token throughput (tok/s):", metrics["total_token_throughput"])]
    for name in LATENCY_METRICS:
        short = name.upper()
        lines += ["{:-^52}".format(METRIC_TITLES[name]),
                  row(f"Mean {short} (ms):", metrics[name]["mean_ms"]),
                  row(f"Median {short} (ms):", metrics[name]["p50_ms"]),
                  row(f"P99 {short} (ms):", metrics[name]["p99_ms"])]
    lines.append("=" * 52)
    lines += [f"{count} failed: {error}" for error, count in metrics["errors"].items()]
    return "\n".join(lines)


def plot_latencies(results: dict[str, Any], path: Path) -> None:
    """PNG of each request's TTFT and E2E latency (ms) against its send time (s); failures as red crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = results["requests"]
    ok = [r for r in requests if r["success"]]
    failed = [r for r in requests if not r["success"]]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.scatter([r["send_time"] for r in ok], [r["e2e"] * 1000 for r in ok], s=10, label="E2E latency")
    ax.scatter([r["send_time"] for r in ok if r["ttft"] is not None],
               [r["ttft"] * 1000 for r in ok if r["ttft"] is not None], s=10, label="TTFT")
    if failed:
        ax.scatter([r["send_time"] for r in failed], [r["e2e"] * 1000 for r in failed], s=20, c="red", marker="x",
                   label="failed (time to failure)")
    config = results["config"]
    title = f"{config['model']}: {config['num_prompts']} requests, rate {config['request_rate']} req/s"
    if config["max_concurrency"]:
        title += f", at most {config['max_concurrency']} in flight"
    ax.set(xlabel="send time (s)", ylabel="latency (ms)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def benchmark_launched(base_url: str, requests: list[RequestSpec], request_rate: float,
                       args: argparse.Namespace) -> dict[str, Any]:
    """The requests against a server that --compare-offline launched, under the model id it serves."""
    return uvloop.run(run_benchmark(base_url, first_model(base_url, args.api_key), requests, request_rate,
                                     api_key=args.api_key, seed=args.seed, progress=not args.no_progress))


def compare_offline(args: argparse.Namespace) -> dict[str, Any]:
    """Warmed offline LLM.generate and a launched server, alternately at saturation for --rounds rounds, then
    the server at half its median request throughput there."""
    import serve_compare  # the engine and torch: only this mode needs them

    model = serve_compare.model_folder(args.model_path)
    settings = serve_compare.EngineSettings(
        args.dtype, args.max_num_seqs, args.max_num_batched_tokens,
        args.max_waiting_requests or max(DEFAULT_MAX_WAITING_REQUESTS, args.num_prompts))
    vocab = serve_compare.model_vocab(model) if args.vocab is None else args.vocab
    requests = make_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    warm_up = [RequestSpec(r.prompt, min(r.output_len, WARM_UP_OUTPUT_LEN)) for r in requests]
    if args.engine_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.engine_threads)  # both engine cores are child processes
    rounds = []
    prompts, output_lens = [r.prompt for r in requests], [r.output_len for r in requests]
    with (serve_compare.OfflineEngine(model, settings) as offline,
          serve_compare.launched_server(model, settings) as server):
        # A first run at a new batch size is up to 40% slower (the allocators grow, fresh memory faults in; seen
        # here): neither side times one.
        offline.run(prompts, [r.output_len for r in warm_up])
        benchmark_launched(server.base_url, warm_up, math.inf, args)
        for _ in range(args.rounds):
            offline_run = offline.run(prompts, output_lens)
            saturation = benchmark_launched(server.base_url, requests, math.inf, args)
            if not saturation["metrics"]["completed"]:
                raise RuntimeError(f"no request completed at saturation: {saturation['metrics']['errors']}")
            rounds.append({"offline": offline_run, "saturation": saturation,
                           "http_offline_ratio": saturation["metrics"]["output_token_throughput"]
                           / offline_run["output_token_throughput"]})
        half_rate = statistics.median(r["saturation"]["metrics"]["request_throughput"] for r in rounds) / 2
        half_saturation = benchmark_launched(server.base_url, requests, half_rate, args)
    config = {"model_path": model, **asdict(settings), "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "vocab": vocab, "seed": args.seed,
              "rounds": args.rounds, "engine_threads": args.engine_threads}
    return {"config": config, "rounds": rounds, "half_saturation": half_saturation,
            "http_offline_ratio": statistics.median(r["http_offline_ratio"] for r in rounds),
            "target_ratio": HTTP_OFFLINE_TARGET, "launcher_exit_code": server.exit_code}


def saturation_failures(results: dict[str, Any]) -> int:
    return sum(r["saturation"]["metrics"]["failed"] for r in results["rounds"])


def format_comparison(results: dict[str, Any]) -> str:
    half = results["half_saturation"]["metrics"]
    ratio, target = results["http_offline_ratio"], results["target_ratio"]
    verdict = "met" if ratio >= target else "NOT met"
    threads = results["config"]["engine_threads"] or "every core"
    lines = ["{:=^60}".format(" HTTP all at once vs offline LLM.generate "), f"Engine threads: {threads}"]
    for index, round_ in enumerate(results["rounds"], 1):
        offline, http = round_["offline"], round_["saturation"]["metrics"]
        lines.append(f"Round {index}: offline {offline['output_token_throughput']:8.2f} tok/s | HTTP "
                     f"{http['output_token_throughput']:8.2f} tok/s, {http['request_throughput']:5.2f} req/s | "
                     f"{round_['http_offline_ratio']:.1%}")
    errors = Counter()
    for metrics in [r["saturation"]["metrics"] for r in results["rounds"]] + [half]:
        errors.update(metrics["errors"])
    lines += [row(f"Median HTTP / offline (target >= {target:.0%}: {verdict}):", f"{ratio:.1%}"),
              "{:-^60}".format(f" Poisson at {results['half_saturation']['config']['request_rate']:.2f} req/s "
                               "(half saturation) "),
              row("Median TTFT (ms):", half["ttft"]["p50_ms"]),
              row("P99 TTFT (ms):", half["ttft"]["p99_ms"]),
              row("Median TPOT (ms):", half["tpot"]["p50_ms"]),
              row("P99 TPOT (ms):", half["tpot"]["p99_ms"]),
              "=" * 60,
              row("Failed requests (saturation / half):", f"{saturation_failures(results)} / {half['failed']}"),
              row("Launcher exit code (SIGTERM):", results["launcher_exit_code"])]
    lines += [f"{count} failed: {error}" for error, count in errors.items()]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model id (default: the first that GET /v1/models lists)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests/s as a Poisson process (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, help=f"prompt ids are drawn from [3, vocab) (default: {DEFAULT_VOCAB}; "
                                                  "with --compare-offline the model's vocabulary size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write config, metrics and per-request results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of per-request latency vs send time here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    compare = parser.add_argument_group("offline comparison", "a launched server instead of --base-url")
    compare.add_argument("--compare-offline", action="store_true",
                         help="HTTP vs offline LLM.generate on the same requests (see above)")
    compare.add_argument("--rounds", type=int, default=5,
                         help="offline and HTTP runs alternate this many times; the median ratio counts")
    compare.add_argument("--engine-threads", type=int,
                         help="OMP_NUM_THREADS for both engine cores (default: unset, torch uses every core). On a "
                         "small CPU host the engine's threads share cores with the gateway and this client; one core "
                         "fewer leaves them one, as vLLM's CPU backend advises")
    compare.add_argument("--model-path", help="model folder (default: the model maker's random ~30M llama)")
    compare.add_argument("--dtype", default="bfloat16")
    compare.add_argument("--max-num-seqs", type=int, default=256)
    compare.add_argument("--max-num-batched-tokens", type=int, default=2048)
    compare.add_argument("--max-waiting-requests", type=int, help="the server's limit, more get HTTP 429 "
                         f"(default: the larger of {DEFAULT_MAX_WAITING_REQUESTS} and --num-prompts)")
    args = parser.parse_args()
    if args.compare_offline and (args.model or args.max_concurrency or not math.isinf(args.request_rate)):
        parser.error("--compare-offline chooses the model id and request rates itself and caps no concurrency: "
                     "drop --model (see --model-path), --request-rate and --max-concurrency")
    if args.max_waiting_requests is not None and args.max_waiting_requests < args.num_prompts:
        parser.error("--max-waiting-requests must be >= --num-prompts: more waiting requests get HTTP 429")
    return args


def benchmark_gateway(args: argparse.Namespace) -> dict[str, Any]:
    """The requests against the running gateway at --base-url."""
    base_url = args.base_url.rstrip("/")
    model = args.model or first_model(base_url, args.api_key)
    vocab = DEFAULT_VOCAB if args.vocab is None else args.vocab
    requests = make_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    results = uvloop.run(run_benchmark(base_url, model, requests, args.request_rate, api_key=args.api_key,
                                        max_concurrency=args.max_concurrency, seed=args.seed,
                                        progress=not args.no_progress))
    results["config"].update(input_len=args.input_len, output_len=args.output_len, vocab=vocab)
    return results


def main() -> int:
    args = parse_args()
    if args.compare_offline:
        results = compare_offline(args)
        latency_run = results["half_saturation"]
        print(format_comparison(results))
        ok = (results["launcher_exit_code"] == 0 and not saturation_failures(results)
              and not latency_run["metrics"]["failed"])
    else:
        results = latency_run = benchmark_gateway(args)
        print(format_report(results["metrics"]))
        ok = results["metrics"]["completed"] > 0
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot_latencies(latency_run, args.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
