"""int8 weight-only quantization against bf16, each pair measured in the same run.

1. Accuracy on the demo model (trained, so agreement means something): over held-out windows (benchmarks/
   demo_perplexity.py's), the top-1 token of every position through the engine's prompt_logprobs, int8 (LM head
   and tied embeddings included, --quantize-lm-head) vs bf16: agreement and perplexity. Targets (issue 20):
   agreement >= 95% over >= 2,000 positions, perplexity within 2%; weight bytes <= 55% of bf16.
2. Speed on the model maker's "100m" llama (102M parameters, random weights): batch-1 decode tokens/s (one
   request of --decode-tokens tokens, the two engines taking turns for --rounds rounds) and offline throughput at
   batch --batch (requests of 128 prompt + 128 output tokens). Target: batch-1 decode int8 / bf16 >= 1.4x.
3. GGUF (with --llama-server and LLAMA_CPP_DIR, README "GGUF files"): the 100m llama converted to Q8_0 by llama.cpp's
   converter, batch-1 decode ms/token of pagedserve on that file vs llama.cpp's llama-server on the same file
   (benchmarks/decode_latency.py's method: (T(256) - T(1)) / 255, best of 3, taking turns). CPU only.
--device picks where every engine runs ("auto": CUDA when torch sees a GPU).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_device  # noqa: E402
from decode_latency import decode_ms_per_token, llamacpp_run, llamacpp_server, pagedserve_run  # noqa: E402
from decode_latency import prompts as decode_prompts  # noqa: E402
from demo_perplexity import held_out_tokens  # noqa: E402
from frontend import LLM, SamplingParams  # noqa: E402
from launch.make_gguf import make_gguf  # noqa: E402
from launch.make_model import benchmark_cache_dir, make_model  # noqa: E402
from launch.shipped import WEIGHTS_DIR  # noqa: E402

KINDS = {"bf16": {}, "int8": {"quantization": "int8"}}


def accuracy(windows: torch.Tensor, device: str) -> dict:
    """Per kind: the top-1 token and the held-out token's logprob at every scored position, and weight bytes."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    prompts = [{"prompt_token_ids": w.tolist()} for w in windows]
    results = {}
    for kind, quant in (("bf16", {}), ("int8", {"quantization": "int8", "quantize_lm_head": True})):
        llm = LLM(str(WEIGHTS_DIR / "demo"), dtype="bfloat16", in_process=True, **quant, **bench_device.engine_args(device))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        top1, nll = [], 0.0
        for output, window in zip(outputs, windows):
            for entry, token in zip(output.prompt_logprobs[1:], window[1:].tolist()):
                top1.append(next(t for t, logprob in entry.items() if logprob.rank == 1))
                nll -= entry[token].logprob
        results[kind] = {"top1": top1, "nll": nll, "weight_bytes": llm.info.weight_bytes}
        llm.shutdown()
    positions = len(results["bf16"]["top1"])
    agree = sum(a == b for a, b in zip(results["bf16"]["top1"], results["int8"]["top1"])) / positions
    ppl = {kind: math.exp(r["nll"] / positions) for kind, r in results.items()}
    return {"positions": positions, "top1_agreement": agree, "perplexity": ppl,
            "perplexity_change": ppl["int8"] / ppl["bf16"] - 1,
            "weight_bytes": {kind: r["weight_bytes"] for kind, r in results.items()},
            "weight_bytes_ratio": results["int8"]["weight_bytes"] / results["bf16"]["weight_bytes"]}


def decode_speed(model: str, tokens: int, rounds: int, device: str) -> dict:
    """Batch-1 decode tokens/s per kind; both engines up at once, taking turns so drift hits both alike."""
    engines = {kind: LLM(model, dtype="bfloat16", **quant, **bench_device.engine_args(device)) for kind, quant in KINDS.items()}
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    seconds = {kind: 0.0 for kind in KINDS}
    try:
        for llm in engines.values():  # warm-up: first-step allocations, kernel loads
            llm.generate({"prompt_token_ids": list(range(3, 11))}, SamplingParams(max_tokens=8), use_tqdm=False)
        for _ in range(rounds):
            for kind, llm in engines.items():
                start = time.perf_counter()
                llm.generate({"prompt_token_ids": list(range(3, 11))}, params, use_tqdm=False)
                seconds[kind] += time.perf_counter() - start
    finally:
        for llm in engines.values():
            llm.shutdown()
    rates = {kind: rounds * tokens / s for kind, s in seconds.items()}
    return {"tokens_per_s": rates, "ratio": rates["int8"] / rates["bf16"]}


def batch_throughput(model: str, batch: int, device: str) -> dict:
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 8000 for j in range(128)]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    rates = {}
    for kind, quant in KINDS.items():
        llm = LLM(model, dtype="bfloat16", **quant, **bench_device.engine_args(device))
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates[kind] = batch * 128 / (time.perf_counter() - start)
        llm.shutdown()
    return {"output_tokens_per_s": rates, "ratio": rates["int8"] / rates["bf16"]}


def gguf_versus_llamacpp(model: str, server: str) -> dict:
    """Batch-1 decode ms/token on the model's Q8_0 GGUF: pagedserve and llama-server (2 threads) on one file."""
    gguf = str(make_gguf(Path(model), Path(model + "-q8_0.gguf"), "q8_0"))
    requests = decode_prompts(1, 8000)
    llm = LLM(gguf, tokenizer=model, dtype="bfloat16")
    try:
        with llamacpp_server(server, gguf, 1) as url:
            ms = decode_ms_per_token({"pagedserve": pagedserve_run(llm, requests),
                                      "llama.cpp": llamacpp_run(url, requests)})
    finally:
        llm.shutdown()
    return {"file": gguf, "ms_per_token": ms, "speed_ratio": ms["llama.cpp"] / ms["pagedserve"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of the demo model's context")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server: compare on the same Q8_0 GGUF file "
                                                "(LLAMA_CPP_DIR names the llama.cpp checkout that converts it)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    device = bench_device.resolve(args.device)
    print(bench_device.describe(device))
    windows = held_out_tokens(WEIGHTS_DIR / "demo", args.windows)
    results = {"device": device, "accuracy": accuracy(windows, device)}
    acc = results["accuracy"]
    print(f"demo model, {acc['positions']} held-out positions: top-1 agreement int8 / bf16 {acc['top1_agreement']:.2%}"
          f" (target >= 95%); perplexity bf16 {acc['perplexity']['bf16']:.3f}, int8 {acc['perplexity']['int8']:.3f}"
          f" ({acc['perplexity_change']:+.2%}, target within 2%); weight bytes {acc['weight_bytes']['int8']} / "
          f"{acc['weight_bytes']['bf16']} = {acc['weight_bytes_ratio']:.1%} (target <= 55%)")
    model = str(make_model(benchmark_cache_dir() / "benchmark-model-100m", "llama", "100m"))
    decode = results["decode"] = decode_speed(model, args.decode_tokens, args.rounds, device)
    print(f"100M llama, batch-1 decode: bf16 {decode['tokens_per_s']['bf16']:.1f} tok/s, int8 "
          f"{decode['tokens_per_s']['int8']:.1f} tok/s: {decode['ratio']:.2f}x (target >= 1.4x)")
    batch = results["batch"] = batch_throughput(model, args.batch, device)
    print(f"100M llama, {args.batch} requests at once: bf16 {batch['output_tokens_per_s']['bf16']:.1f} output tok/s,"
          f" int8 {batch['output_tokens_per_s']['int8']:.1f}: {batch['ratio']:.2f}x")
    if args.llama_server and device == "cuda":
        print("--llama-server: skipped on CUDA (llama-server here is the CPU peer of a CPU measurement)")
    elif args.llama_server:
        gguf = results["gguf"] = gguf_versus_llamacpp(model, args.llama_server)
        print(f"100M llama as Q8_0 GGUF, batch-1 decode: pagedserve {gguf['ms_per_token']['pagedserve']:.2f} ms/token,"
              f" llama.cpp {gguf['ms_per_token']['llama.cpp']:.2f} ms/token: pagedserve / llama.cpp speed "
              f"{gguf['speed_ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
