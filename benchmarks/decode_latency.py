"""Decode at small batch: this engine vs llama.cpp's llama-server on the same model and prompts, one run.

For each batch size b, b requests of 64 random prompt tokens each decode 256 tokens (greedy, ignore_eos; with --sampled
by llama-server's default sampling: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), all at once; the same requests
with 1 output token give the prefill time, so the decode time per token is (T(256) - T(1)) / 255, best of 3 each, the
two systems taking turns. pagedserve is timed offline (`LLM.generate`, engine-core process, bf16); llama.cpp through its
HTTP server (b slots, 2 threads, the model converted to a bf16 GGUF), whose client cost is small against a 256-token
request. --http also streams the same requests through both HTTP servers (pagedserve's `python -m launch`, OpenAI
/v1/completions for both) and prints the mean time per output token, best of 3 rounds. Also printed: the memory floor of
batch-1 decode, the bytes of the weights each token reads (every linear layer and the LM head, not the embedding table)
over the copy bandwidth measured here (read + write bytes of a 256 MiB copy per second), and pagedserve's share of it.
Target (issue 24): batch 1 >= 1x llama.cpp and >= 80% of the floor.

Build llama-server and the GGUF as the README says, then:
    python benchmarks/decode_latency.py --compare-llamacpp PATH/llama-server --gguf model-bf16.gguf
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve  # noqa: E402
import serve_compare  # noqa: E402
from llamacpp import complete, llamacpp_server  # noqa: E402
from roofline import Shape  # noqa: E402

from frontend import LLM, SamplingParams  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from launch.make_model import ensure_benchmark_model  # noqa: E402
from workers.model_config import load_hf_config  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS, REPEATS = 64, 256, 3
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama-server's defaults
SLOT_TOKENS = PROMPT_TOKENS + OUTPUT_TOKENS + 16


def prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed + batch)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]


def _timed(run, max_tokens: int) -> float:
    start = time.perf_counter()
    run(max_tokens)
    return time.perf_counter() - start


def decode_ms_per_token(runs: dict[str, Callable[[int], None]]) -> dict[str, float]:
    """Each system's (T(256) - T(1)) / 255 in ms, best of REPEATS; the systems take turns, round by round, so
    that the machine's drift hits them alike."""
    best = {name: {1: float("inf"), OUTPUT_TOKENS: float("inf")} for name in runs}
    for _ in range(REPEATS):
        for name, run in runs.items():
            for max_tokens in best[name]:
                best[name][max_tokens] = min(best[name][max_tokens], _timed(run, max_tokens))
    return {name: (b[OUTPUT_TOKENS] - b[1]) / (OUTPUT_TOKENS - 1) * 1e3 for name, b in best.items()}


def pagedserve_run(llm: LLM, requests: list[list[int]], sampling: dict | None) -> Callable[[int], None]:
    prompts = [{"prompt_token_ids": p} for p in requests]

    def run(max_tokens: int) -> None:
        params = SamplingParams(**(sampling or {"temperature": 0.0}), max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return run


def llamacpp_run(base_url: str, requests: list[list[int]], sampling: dict | None) -> Callable[[int], None]:
    def run(max_tokens: int) -> None:
        with ThreadPoolExecutor(len(requests)) as pool:
            counts = list(pool.map(lambda p: complete(base_url, p, max_tokens, sampling), requests))
        assert all(n == max_tokens for n in counts), counts
    return run


@dataclass(frozen=True)
class ServerFlags:
    """The launched pagedserve server's flags (serve_compare.launched_server takes any launcher_flags())."""
    flags: tuple[str, ...] = ("--dtype", "bfloat16")

    def launcher_flags(self) -> list[str]:
        return list(self.flags)


def http_tpot_ms(base_url: str, model: str, requests: list[list[int]]) -> Callable[[], float]:
    """One round of the requests streamed at once through an OpenAI /v1/completions endpoint: mean TPOT in ms."""
    specs = [serve.RequestSpec(prompt=p, output_len=OUTPUT_TOKENS) for p in requests]

    def run() -> float:
        metrics = asyncio.run(serve.run_benchmark(base_url, model, specs))["metrics"]
        assert metrics["failed"] == 0 and metrics["total_output_tokens"] == OUTPUT_TOKENS * len(specs), metrics
        return metrics["tpot"]["mean_ms"]
    return run


def http_figures(model: str, server: str | None, gguf: str | None, batches: list[int], vocab: int
                 ) -> tuple[dict[int, float], dict[int, float]]:
    """Best-of-REPEATS mean TPOT per batch size through each system's HTTP server, rounds taking turns."""
    ours, theirs = {}, {}
    with serve_compare.launched_server(model, ServerFlags()) as launched:
        served = serve.first_model(launched.base_url, None)
        for batch in batches:
            requests = prompts(batch, vocab)
            with contextlib.ExitStack() as stack:
                runs = {"pagedserve": http_tpot_ms(launched.base_url, served, requests)}
                if gguf:
                    url = stack.enter_context(llamacpp_server(server, gguf, batch, SLOT_TOKENS))
                    runs["llama.cpp"] = http_tpot_ms(url, "gguf", requests)
                best = _alternating_best(runs)
            ours[batch] = best["pagedserve"]
            if "llama.cpp" in best:
                theirs[batch] = best["llama.cpp"]
    return ours, theirs


def _alternating_best(runs: dict[str, Callable[[], float]]) -> dict[str, float]:
    for run in runs.values():
        run()  # warm-up
    rounds = [{name: run() for name, run in runs.items()} for _ in range(REPEATS)]
    return {name: min(r[name] for r in rounds) for name in runs}


def copy_bandwidth() -> float:
    """Read + write bytes per second of a 256 MiB copy, best of 10."""
    source = torch.ones(64 * 2**20)
    target = torch.empty_like(source)
    seconds = min(_timed(lambda _: target.copy_(source), 0) for _ in range(10))
    return 2 * source.numel() * source.element_size() / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the model maker's ~30M llama)")
    parser.add_argument("--compare-llamacpp", metavar="LLAMA_SERVER", help="path to llama.cpp's llama-server")
    parser.add_argument("--gguf", help="the same model as a bf16 GGUF (with --compare-llamacpp)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--http", action="store_true",
                        help="also stream through each system's HTTP server (pagedserve: `python -m launch`): TPOT")
    parser.add_argument("--sampled", action="store_true",
                        help="offline runs sample as llama-server does by default (HTTP streaming stays greedy)")
    args = parser.parse_args()
    if bool(args.compare_llamacpp) != bool(args.gguf):
        parser.error("--compare-llamacpp and --gguf go together")
    warnings.filterwarnings("ignore")
    model = args.model or str(ensure_benchmark_model())
    vocab = load_hf_config(model).vocab_size
    floor_ms = Shape.of(model).weight_bytes() / copy_bandwidth() * 1e3
    ours, theirs = {}, {}
    llm = LLM(model, dtype="bfloat16")
    try:
        for batch in args.batch_sizes:
            requests = prompts(batch, vocab)
            with contextlib.ExitStack() as stack:
                sampling = SAMPLED if args.sampled else None
                runs = {"pagedserve": pagedserve_run(llm, requests, sampling)}
                if args.gguf:
                    url = stack.enter_context(llamacpp_server(args.compare_llamacpp, args.gguf, batch, SLOT_TOKENS))
                    runs["llama.cpp"] = llamacpp_run(url, requests, sampling)
                for run in runs.values():
                    run(8)  # warm-up: first use of the kernels and the allocator's pages
                figures = decode_ms_per_token(runs)
            ours[batch] = figures["pagedserve"]
            if "llama.cpp" in figures:
                theirs[batch] = figures["llama.cpp"]
    finally:
        llm.shutdown()
    http = http_figures(model, args.compare_llamacpp, args.gguf, args.batch_sizes, vocab) if args.http else None
    print(f"CPU native bf16: {cpu_has_native_bf16()}; memory floor of batch-1 decode: {floor_ms:.2f} ms/token; "
          f"offline: {'sampled ' + str(SAMPLED) if args.sampled else 'greedy'}")
    for batch in args.batch_sizes:
        line = (f"batch {batch:3d}: pagedserve {ours[batch]:6.2f} ms/step "
                f"({batch * 1e3 / ours[batch]:7.1f} tok/s)")
        if batch in theirs:
            line += (f" | llama.cpp {theirs[batch]:6.2f} ms/step ({batch * 1e3 / theirs[batch]:7.1f} tok/s)"
                     f" | pagedserve / llama.cpp speed {theirs[batch] / ours[batch]:.2f}x")
        if batch == 1:
            line += f" | {floor_ms / ours[batch]:.0%} of the memory floor"
        print(line)
    for batch in args.batch_sizes if http else []:
        ours_tpot, theirs_tpot = http[0][batch], http[1].get(batch)
        line = f"HTTP streaming, batch {batch:3d}: pagedserve TPOT {ours_tpot:6.2f} ms"
        if theirs_tpot is not None:
            line += f" | llama.cpp TPOT {theirs_tpot:6.2f} ms | pagedserve / llama.cpp speed {theirs_tpot / ours_tpot:.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
