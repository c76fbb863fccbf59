"""Serving benchmark against any OpenAI-compatible server (ours, llama.cpp's, vLLM's), like `vllm bench serve`.

Requests come from a ShareGPT-format JSON file (--dataset-name sharegpt; default: benchmarks/data/sharegpt_demo.json,
made by benchmarks/data/make_sharegpt_demo.py) or are random token ids (--dataset-name random). They are streamed to
/v1/completions or /v1/chat/completions (--endpoint), all at once (--request-rate inf) or as a seeded Poisson process,
optionally at most --max-concurrency in flight; several rates (--request-rate 1,2,inf) run one after another. Each
run prints request and token throughput and the mean, p50, p90 and p99 of TTFT, TPOT, ITL and E2E latency (see
serve_client.py for how each is measured); --save-result writes them with every request's measurements, --plot a PNG
(latency percentiles over load for several rates, each request's latencies for one). --tokenizer FOLDER counts
dataset tokens exactly (else they are estimated from characters) and output tokens where the server reports no usage.

--compare-offline needs no running server: see serve_offline.py. The core is importable: serve_dataset builds
requests, serve_client.run_benchmark runs them (re-exported here for the other benchmarks).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import uvloop

from serve_client import Workload, first_model, run_benchmark
from serve_dataset import RequestSpec, load_tokenizer, random_requests, sharegpt_requests
from serve_report import format_report

__all__ = ["RequestSpec", "first_model", "make_requests", "run_benchmark"]

DEFAULT_DATASET = Path(__file__).resolve().parent / "data" / "sharegpt_demo.json"
DEFAULT_RANDOM_VOCAB = 4096  # the demo model's: its ids are valid on the server a plain `python -m launch` starts
WARM_UP_OUTPUT_LEN = 4


def make_requests(num_prompts: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[RequestSpec]:
    """Random token-id prompts (the other benchmarks' workload)."""
    return random_requests(num_prompts, input_len, output_len, seed, vocab)


def request_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rates are numbers or inf, comma-separated: not {text!r}") from None
    if not rates or any(not rate > 0 for rate in rates):
        raise argparse.ArgumentTypeError("every request rate must be > 0 (inf: all at once)")
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", help="model id (default: the first that GET /v1/models lists)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--dataset-name", choices=("sharegpt", "random"), default="sharegpt")
    parser.add_argument("--dataset-path", type=Path, default=DEFAULT_DATASET, help="a ShareGPT-format JSON file")
    parser.add_argument("--sharegpt-output-len", type=int, help="every request's output length (default: its answer's)")
    parser.add_argument("--max-total-len", type=int, default=2048,
                        help="ShareGPT pairs whose prompt and answer are longer together are skipped")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=request_rates, default=[math.inf],
                        help="requests/s as a Poisson process, several comma-separated (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    parser.add_argument("--random-input-len", "--input-len", type=int, default=128)
    parser.add_argument("--random-output-len", "--output-len", type=int, default=128)
    parser.add_argument("--random-vocab", "--vocab", dest="vocab", type=int,
                        help=f"random prompt ids come from [3, vocab) (default: the tokenizer's size, else "
                             f"{DEFAULT_RANDOM_VOCAB}; with --compare-offline the model's)")
    parser.add_argument("--tokenizer", help="the model's folder: count tokens with its tokenizer")
    parser.add_argument("--ignore-eos", action="store_true", help="every request runs to its output length")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", "--json", dest="save_result", type=Path,
                        help="write every run's config, figures and per-request results here")
    parser.add_argument("--plot", type=Path, help="write a PNG here (needs matplotlib: the bench extra)")
    parser.add_argument("--label", default="", help="the plot's title")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    compare = parser.add_argument_group("offline comparison", "a launched server instead of --base-url")
    compare.add_argument("--compare-offline", action="store_true",
                         help="HTTP vs offline LLM.generate on random requests (serve_offline.py)")
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
                         "(default: the larger of 1024 and --num-prompts)")
    args = parser.parse_args(argv)
    if args.compare_offline and (args.model or args.max_concurrency or args.request_rate != [math.inf]):
        parser.error("--compare-offline chooses the model id and request rates itself and caps no concurrency: "
                     "drop --model (see --model-path), --request-rate and --max-concurrency")
    if args.max_waiting_requests is not None and args.max_waiting_requests < args.num_prompts:
        parser.error("--max-waiting-requests must be >= --num-prompts: more waiting requests get HTTP 429")
    if args.endpoint == "chat" and args.dataset_name == "random" and not args.tokenizer:
        parser.error("random prompts on the chat endpoint are text: give --tokenizer to decode them")
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    return args


def dataset(args: argparse.Namespace) -> tuple[list[RequestSpec], Workload, dict[str, Any]]:
    tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset_name == "sharegpt":
        requests = sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, tokenizer, args.max_total_len,
                                     args.sharegpt_output_len)
        described = {"dataset_name": "sharegpt", "dataset_path": str(args.dataset_path)}
    else:
        vocab = args.vocab or (len(tokenizer) if tokenizer is not None else DEFAULT_RANDOM_VOCAB)
        requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.seed, vocab,
                                   tokenizer if args.endpoint == "chat" else None)
        described = {"dataset_name": "random", "input_len": args.random_input_len,
                     "output_len": args.random_output_len, "vocab": vocab}
    workload = Workload(args.endpoint, args.ignore_eos, args.temperature, tokenizer)
    return requests, workload, {**described, "tokenizer": args.tokenizer}


def benchmark_server(args: argparse.Namespace) -> dict[str, Any]:
    """A warm-up request, then the requests at each rate, against the server at --base-url."""
    requests, workload, described = dataset(args)
    base_url = args.base_url.rstrip("/")
    model = args.model or first_model(base_url, args.api_key)
    warm_up = [RequestSpec(requests[0].prompt, min(requests[0].output_len, WARM_UP_OUTPUT_LEN))]
    check = uvloop.run(run_benchmark(base_url, model, warm_up, api_key=args.api_key, workload=workload))
    if check["metrics"]["failed"]:
        raise SystemExit(f"the warm-up request failed: {next(iter(check['metrics']['errors']))}")
    runs = []
    for rate in args.request_rate:
        run = uvloop.run(run_benchmark(base_url, model, requests, rate, api_key=args.api_key,
                                       max_concurrency=args.max_concurrency, seed=args.seed, workload=workload,
                                       progress=not args.no_progress))
        run["config"].update(described)
        print(format_report(run), flush=True)
        runs.append(run)
    return {"runs": runs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare_offline:
        import serve_offline

        results = serve_offline.compare_offline(args)
        runs = [results["half_saturation"]]
        print(serve_offline.format_comparison(results))
        ok = serve_offline.passed(results)
    else:
        results = benchmark_server(args)
        runs = results["runs"]
        ok = not any(run["metrics"]["failed"] for run in runs)
    if args.save_result:
        args.save_result.write_text(json.dumps(results, indent=1))
    if args.plot:
        from serve_plot import plot_runs

        plot_runs(runs, args.plot, args.label)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
