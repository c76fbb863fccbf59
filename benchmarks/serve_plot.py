"""The serving benchmark's PNG: latency percentiles over load for several request rates, or one run's requests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from serve_report import LATENCY_METRICS, METRIC_TITLES, PERCENTILES


def _pyplot():
    import matplotlib  # the `bench` extra: only a plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """One run: each request's TTFT and E2E against its send time. Several: TTFT, TPOT, ITL and E2E percentiles
    against the request throughput each run achieved, each point marked with the rate it was sent at."""
    if len(runs) == 1:
        _plot_requests(runs[0], path, title)
    else:
        _plot_over_load(runs, path, title)


def _plot_over_load(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    achieved = [run["metrics"]["request_throughput"] for run in runs]
    for ax, name in zip(axes.flat, LATENCY_METRICS):
        for p in PERCENTILES:
            values = [run["metrics"][name][f"p{p}_ms"] for run in runs]
            ax.plot(achieved, [float("nan") if v is None else v for v in values], marker="o", label=f"p{p}")
        for run, x in zip(runs, achieved):
            top = run["metrics"][name]["p99_ms"]
            if top is not None:
                ax.annotate(f"rate {run['config']['request_rate']}", (x, top), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=7)
        ax.set(title=METRIC_TITLES[name], xlabel="achieved request throughput (req/s)", ylabel="ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or f"{runs[0]['config']['model']}: latency over load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_requests(run: dict[str, Any], path: Path, title: str) -> None:
    plt = _pyplot()
    requests = run["requests"]
    ok = [r for r in requests if r["success"]]
    failed = [r for r in requests if not r["success"]]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.scatter([r["send_time"] for r in ok], [r["e2e"] * 1000 for r in ok], s=10, label="E2E latency")
    timed = [r for r in ok if r["ttft"] is not None]
    ax.scatter([r["send_time"] for r in timed], [r["ttft"] * 1000 for r in timed], s=10, label="TTFT")
    if failed:
        ax.scatter([r["send_time"] for r in failed], [r["e2e"] * 1000 for r in failed], s=20, c="red", marker="x",
                   label="failed (time to failure)")
    config = run["config"]
    default = f"{config['model']}: {config['num_prompts']} requests, rate {config['request_rate']} req/s"
    if config["max_concurrency"]:
        default += f", at most {config['max_concurrency']} in flight"
    ax.set(xlabel="send time (s)", ylabel="latency (ms)", title=title or default)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
