"""`serve.py --compare-offline`: a launched server's all-at-once output throughput against offline `LLM.generate`.

On --model-path (default: the benchmark model) it keeps an offline `LLM` and a launched server (`python -m launch` on
a free loopback port, same engine settings) up side by side and warms both with every request cut to a few tokens.
Then, --rounds times, it runs the requests through offline `LLM.generate` (greedy, ignore_eos) and sends them all at
once to the server (saturation). Target: output tokens/s through HTTP >= 90% of offline, as the median of the rounds'
ratios (this machine's speed drifts by more than 10% between runs, so one run misleads). It then sends the requests
as a Poisson process at half the median saturation request throughput (TTFT and TPOT there) and stops the launcher
with SIGTERM.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
from collections import Counter
from dataclasses import asdict
from typing import Any

import uvloop

import serve_compare  # the engine and torch: only this mode needs them
from serve_client import first_model, run_benchmark
from serve_dataset import RequestSpec, random_requests
from serve_report import row

DEFAULT_MAX_WAITING_REQUESTS = 1024  # the launcher's
WARM_UP_OUTPUT_LEN = 16  # every request, this short, untimed on each side first
HTTP_OFFLINE_TARGET = 0.90  # issue 4: all-at-once output tokens/s through HTTP over offline LLM.generate


def benchmark_launched(base_url: str, requests: list[RequestSpec], request_rate: float,
                       args: argparse.Namespace) -> dict[str, Any]:
    """The requests against the launched server, under the model id it serves."""
    return uvloop.run(run_benchmark(base_url, first_model(base_url, args.api_key), requests, request_rate,
                                     api_key=args.api_key, seed=args.seed, progress=not args.no_progress))


def compare_offline(args: argparse.Namespace) -> dict[str, Any]:
    """Warmed offline LLM.generate and a launched server, alternately at saturation for --rounds rounds, then
    the server at half its median request throughput there."""
    model = serve_compare.model_folder(args.model_path)
    settings = serve_compare.EngineSettings(
        args.dtype, args.max_num_seqs, args.max_num_batched_tokens,
        args.max_waiting_requests or max(DEFAULT_MAX_WAITING_REQUESTS, args.num_prompts))
    vocab = serve_compare.model_vocab(model) if args.vocab is None else args.vocab
    requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.seed, vocab)
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
              "input_len": args.random_input_len, "output_len": args.random_output_len, "vocab": vocab,
              "seed": args.seed, "rounds": args.rounds, "engine_threads": args.engine_threads}
    return {"config": config, "rounds": rounds, "half_saturation": half_saturation,
            "http_offline_ratio": statistics.median(r["http_offline_ratio"] for r in rounds),
            "target_ratio": HTTP_OFFLINE_TARGET, "launcher_exit_code": server.exit_code}


def saturation_failures(results: dict[str, Any]) -> int:
    return sum(r["saturation"]["metrics"]["failed"] for r in results["rounds"])


def passed(results: dict[str, Any]) -> bool:
    return (results["launcher_exit_code"] == 0 and not saturation_failures(results)
            and not results["half_saturation"]["metrics"]["failed"])


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
    errors: Counter[str] = Counter()
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
