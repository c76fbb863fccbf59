"""Mixture of experts: the engine vs HF transformers on a Mixtral-shaped random model, and the fused-MoE layer vs
the per-expert loop HF runs, each pair measured in the same run, on --device ("auto": CUDA when torch sees a GPU).

1. Offline throughput (bf16): random-token requests through `LLM` and through HF `generate` on static padded
   batches (benchmarks/throughput.py's two runners), on the model maker's "30m" Mixtral with 8 experts, top-2.
   Target (issue 19): ratio >= 5x.
2. The MoE layer alone at --layer-tokens tokens (default 256, the target's size): kernels.fused_moe's
   fused_experts as the engine runs it (the torch twin on CPU, the Triton kernel on CUDA) vs moe_per_expert_loop
   on the same weights and routing, in float32 and bf16, the two alternating for --layer-rounds rounds.
   Target: >= 3x (bf16 at 256 tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_device  # noqa: E402
import throughput  # noqa: E402
from kernels import cpu_extension  # noqa: E402
from kernels.fused_moe import fused_experts  # noqa: E402
from kernels.fused_moe_ref import moe_per_expert_loop, select_experts  # noqa: E402
from launch.make_model import benchmark_cache_dir, make_model  # noqa: E402

THROUGHPUT_TARGET = 5.0
LAYER_TARGET = 3.0
NUM_EXPERTS, TOP_K = 8, 2


def moe_benchmark_model() -> Path:
    return make_model(benchmark_cache_dir() / "moe-benchmark-model", "mixtral", "30m", num_local_experts=NUM_EXPERTS,
                      num_experts_per_tok=TOP_K)


@torch.inference_mode()
def time_layer(tokens: int, hidden: int, inter: int, dtype: torch.dtype, rounds: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(0)  # drawn on the CPU: the same values on either device
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=gen) * 0.02).to(device, dtype)
    down = (torch.randn(NUM_EXPERTS, hidden, inter, generator=gen) * 0.02).to(device, dtype)
    router_logits = torch.randn(tokens, NUM_EXPERTS, generator=gen).to(device)
    weights, ids = select_experts(router_logits, TOP_K, renormalize=True)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    seconds = {"fused": 0.0, "loop": 0.0}
    runners = {"fused": fused_experts, "loop": moe_per_expert_loop}
    for name, run in runners.items():  # warm-up: first-call allocations and the GEMV kernel's load
        run(x, gate_up, down, weights, ids)
    for _ in range(rounds):
        for name, run in runners.items():
            synchronize()
            start = time.perf_counter()
            run(x, gate_up, down, weights, ids)
            synchronize()
            seconds[name] += time.perf_counter() - start
    return {"tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
            "fused_ms": 1000 * seconds["fused"] / rounds, "loop_ms": 1000 * seconds["loop"] / rounds,
            "ratio": seconds["loop"] / seconds["fused"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--layer-tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--layer-rounds", type=int, default=20)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    device = bench_device.resolve(args.device)
    print(bench_device.describe(device))
    if device == "cpu":
        cpu_extension.load()  # as in the engine: few rows per expert take the GEMV kernel
    model = moe_benchmark_model()
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model)
    results: dict = {"model": str(model), "device": device, "layer": []}
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in args.layer_tokens:
            row = time_layer(tokens, config.hidden_size, config.intermediate_size, dtype, args.layer_rounds, device)
            results["layer"].append(row)
            print(f"MoE layer {row['dtype']:>8} x{tokens:<4}: fused {row['fused_ms']:7.2f} ms, per-expert loop "
                  f"{row['loop_ms']:7.2f} ms, ratio {row['ratio']:.2f}x")
    if not args.skip_throughput:
        requests = throughput.make_requests(args.num_requests, config.vocab_size, args.seed, args.input_len,
                                            args.output_len)
        engine = results["engine"] = throughput.run_engine(str(model), requests, args,
                                                           **bench_device.engine_args(device))
        hf = results["hf"] = throughput.run_hf(str(model), requests, args, device)
        results["ratio"] = engine["output_tokens_per_s"] / hf["output_tokens_per_s"]
        print(f"pagedserve: {engine['output_tokens_per_s']:.1f} output tok/s ({engine['seconds']:.1f} s); "
              f"HF transformers (static batches of {args.hf_batch_size}): {hf['output_tokens_per_s']:.1f} "
              f"output tok/s ({hf['seconds']:.1f} s)")
        print(f"ratio pagedserve / HF: {results['ratio']:.2f}x (target >= {THROUGHPUT_TARGET}x)")
    print(f"layer target: >= {LAYER_TARGET}x at 256 tokens")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
