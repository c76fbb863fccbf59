"""Decode at small batch: this engine vs llama.cpp's llama-server on the same model and prompts, one run.

For each batch size b, b requests of 64 random prompt tokens each decode 256 tokens (greedy, ignore_eos), all at
once; the same requests with 1 output token give the prefill time, so the decode time per token is
(T(256) - T(1)) / 255, best of 3 each. pagedserve is timed offline (`LLM.generate`, engine-core process, bf16);
llama.cpp through its HTTP server (b slots, 2 threads, the model converted to a bf16 GGUF), whose client cost is
small against a 256-token request. Also printed: the memory floor of batch-1 decode, the bytes of the weights
each token reads (every linear layer and the LM head, not the embedding table) over the copy bandwidth measured
here (read + write bytes of a 256 MiB copy per second), and pagedserve's share of it. Target (issue 24): batch 1
>= 1x llama.cpp and >= 80% of the floor.

Build llama-server and the GGUF as the README says, then:
    python benchmarks/decode_latency.py --compare-llamacpp PATH/llama-server --gguf model-bf16.gguf
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend import LLM, SamplingParams  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from launch.make_model import ensure_benchmark_model  # noqa: E402
from workers.model_config import load_hf_config  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS, REPEATS = 64, 256, 3


def prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed + batch)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]


def best_seconds(run, max_tokens: int) -> float:
    return min(_timed(run, max_tokens) for _ in range(REPEATS))


def _timed(run, max_tokens: int) -> float:
    start = time.perf_counter()
    run(max_tokens)
    return time.perf_counter() - start


def decode_ms_per_token(run) -> float:
    return (best_seconds(run, OUTPUT_TOKENS) - best_seconds(run, 1)) / (OUTPUT_TOKENS - 1) * 1e3


def pagedserve_figures(model: str, batches: list[int], vocab: int) -> dict[int, float]:
    llm = LLM(model, dtype="bfloat16")
    try:
        figures = {}
        for batch in batches:
            requests = [{"prompt_token_ids": p} for p in prompts(batch, vocab)]

            def run(max_tokens: int) -> None:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                outputs = llm.generate(requests, params, use_tqdm=False)
                assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)

            run(8)  # warm-up: the kernels' first use, the allocator's pages
            figures[batch] = decode_ms_per_token(run)
        return figures
    finally:
        llm.shutdown()


def llamacpp_figures(server: str, gguf: str, batches: list[int], vocab: int) -> dict[int, float]:
    figures = {}
    for batch in batches:
        port = _free_port()
        process = subprocess.Popen([server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "2",
                                    "-tb", "2", "-np", str(batch), "-c", str(batch * (PROMPT_TOKENS + OUTPUT_TOKENS + 16)),
                                    "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(f"http://127.0.0.1:{port}/health", process)
            url = f"http://127.0.0.1:{port}/completion"
            requests = prompts(batch, vocab)

            def run(max_tokens: int) -> None:
                with ThreadPoolExecutor(batch) as pool:
                    counts = list(pool.map(lambda p: _complete(url, p, max_tokens), requests))
                assert all(n == max_tokens for n in counts), counts

            run(8)
            figures[batch] = decode_ms_per_token(run)
        finally:
            process.terminate()
            process.wait(30)
    return figures


def _complete(url: str, prompt: list[int], max_tokens: int) -> int:
    body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0,
                       "cache_prompt": False}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["timings"]["predicted_n"]


def _wait_ready(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError("llama-server did not become ready")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_bandwidth() -> float:
    """Read + write bytes per second of a 256 MiB copy, best of 10."""
    source = torch.ones(64 * 2**20)
    target = torch.empty_like(source)
    seconds = min(_timed(lambda _: target.copy_(source), 0) for _ in range(10))
    return 2 * source.numel() * source.element_size() / seconds


def weight_bytes_per_token(model: str) -> int:
    """bf16 bytes of every matrix a decode step reads once: the layers' projections and the LM head."""
    config = load_hf_config(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    attention = hidden * (config.num_attention_heads + 2 * kv_heads) * head_dim + config.num_attention_heads * head_dim * hidden
    layer = attention + 3 * hidden * inter
    return 2 * (config.num_hidden_layers * layer + config.vocab_size * hidden)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the model maker's ~30M llama)")
    parser.add_argument("--compare-llamacpp", metavar="LLAMA_SERVER", help="path to llama.cpp's llama-server")
    parser.add_argument("--gguf", help="the same model as a bf16 GGUF (with --compare-llamacpp)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    if bool(args.compare_llamacpp) != bool(args.gguf):
        parser.error("--compare-llamacpp and --gguf go together")
    warnings.filterwarnings("ignore")
    model = args.model or str(ensure_benchmark_model())
    vocab = load_hf_config(model).vocab_size
    floor_ms = weight_bytes_per_token(model) / copy_bandwidth() * 1e3
    ours = pagedserve_figures(model, args.batch_sizes, vocab)
    theirs = llamacpp_figures(args.compare_llamacpp, args.gguf, args.batch_sizes, vocab) if args.gguf else {}
    print(f"CPU native bf16: {cpu_has_native_bf16()}; memory floor of batch-1 decode: {floor_ms:.2f} ms/token")
    for batch in args.batch_sizes:
        line = (f"batch {batch:3d}: pagedserve {ours[batch]:6.2f} ms/step "
                f"({batch * 1e3 / ours[batch]:7.1f} tok/s)")
        if batch in theirs:
            line += (f" | llama.cpp {theirs[batch]:6.2f} ms/step ({batch * 1e3 / theirs[batch]:7.1f} tok/s)"
                     f" | pagedserve / llama.cpp speed {theirs[batch] / ours[batch]:.2f}x")
        if batch == 1:
            line += f" | {floor_ms / ours[batch]:.0%} of the memory floor"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
