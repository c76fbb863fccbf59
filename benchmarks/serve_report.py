"""The serving benchmark's figures: throughput and latency percentiles of a run's requests, and their printout."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from serve_client import RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
WIDTH = 56


def summarize(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and PERCENTILES in milliseconds of values in seconds (None when there are none)."""
    keys = ["mean_ms", *(f"p{p}_ms" for p in PERCENTILES)]
    if not len(values_s):
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return dict(zip(keys, [float(ms.mean()), *(float(v) for v in np.percentile(ms, PERCENTILES))]))


def request_latencies(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Each latency's values over the successful requests: TPOT is (E2E - TTFT) / (output tokens - 1), of requests
    with two tokens or more; ITL is every gap of every request."""
    ok = [r for r in results if r.success]
    return {"ttft": [r.ttft for r in ok if r.ttft is not None],
            "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
                     if r.output_tokens > 1 and r.ttft is not None],
            "itl": [gap for r in ok for gap in r.itl],
            "e2e": [r.e2e for r in ok]}


def compute_metrics(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    errors = Counter(r.error for r in results if not r.success)
    return {"duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
            "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
            "output_tokens_from": dict(Counter(r.output_tokens_from for r in ok)),
            "request_throughput": len(ok) / duration,
            "output_token_throughput": output_tokens / duration,
            "total_token_throughput": (input_tokens + output_tokens) / duration,
            **{name: summarize(values) for name, values in request_latencies(results).items()},
            "errors": dict(errors.most_common())}


def row(label: str, value: Any) -> str:
    shown = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<{WIDTH - 12}}{shown:>12}"


def format_report(results: dict[str, Any]) -> str:
    """The run's figures in the layout of `vllm bench serve`'s printout."""
    metrics, config = results["metrics"], results["config"]
    lines = ["{:=^{}}".format(" Serving Benchmark Result ", WIDTH),
             row("Request rate (req/s):", config["request_rate"]),
             row("Max concurrency:", config["max_concurrency"] or "none"),
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
        lines += ["{:-^{}}".format(METRIC_TITLES[name], WIDTH), row(f"Mean {short} (ms):", metrics[name]["mean_ms"])]
        lines += [row(f"P{p} {short} (ms):", metrics[name][f"p{p}_ms"]) for p in PERCENTILES]
    lines.append("=" * WIDTH)
    counted = ", ".join(f"{n} from {source}" for source, n in metrics.get("output_tokens_from", {}).items())
    if counted:
        lines.append(f"Output tokens counted: {counted}")
    lines += [f"{count} failed: {error}" for error, count in metrics["errors"].items()]
    return "\n".join(lines)
