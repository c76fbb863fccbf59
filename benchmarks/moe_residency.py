"""Mixtures of experts at batch 1 against a dense llama of the same total weight bytes: is a row's share the cache's?

benchmarks/feature_speed.py normalises a mixture of experts' batch-1 speed by the bytes a token reads (its top-k
experts' share), as a share of plain llama's GB/s. But a token's experts change from token to token, so the bytes
that must stay cached are all experts', not a token's: a model whose weights outgrow what the caches hold streams
them more slowly, dense or not. This measures, in one run, each family's batch-1 GB/s, plain llama's, and that of a
dense llama (the same hidden size and layers) whose MLP is widened until its weights total the family's: the last
is what plain llama's own fast path reaches on a working set of that size.

--beyond-cache instead: a qwen3_moe-shaped model at feature_speed's beyond-cache width (its experts a quarter of
that MLP wide, 2 of 8 a token) with layers until the bytes a token reads are BEYOND_CACHE_FACTOR x the last-level
cache, against feature_speed's beyond-cache llama: both stream from memory, as real models do, where a mixture of
experts' switching experts no longer meet weights that stay cached.

    python benchmarks/moe_residency.py [--rows mixtral deepseek_v2 ...] [--repeats 5] [--beyond-cache]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from feature_speed import (BEYOND_CACHE_FACTOR, BEYOND_CACHE_HEADS, BEYOND_CACHE_HIDDEN,  # noqa: E402
                           BEYOND_CACHE_INTERMEDIATE, arguments_with_kernels, batch1_turns, beyond_cache_model,
                           last_level_cache_bytes, per_token_cost)
from neighbour import model_dir  # noqa: E402

from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from launch.make_model import benchmark_cache_dir, make_model  # noqa: E402

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
WIDTH_STEP = 64  # the dense reference's intermediate size is a multiple of this


def weight_elements(folder: Path) -> int:
    """Every weight's elements in the checkpoint, embedding included (what must stay cached to stream them)."""
    with safe_open(str(folder / "model.safetensors"), "pt") as tensors:
        return sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())


def dense_reference(folder: Path) -> Path:
    """Plain llama (the llama 30m's hidden size, heads and layers) whose MLP width makes its weights as many as
    `folder`'s, made once."""
    llama = model_dir("llama")
    config = json.loads((llama / "config.json").read_text())
    per_width = 3 * config["hidden_size"] * config["num_hidden_layers"]  # gate, up and down: one column each
    extra = weight_elements(folder) - weight_elements(llama)
    width = max(WIDTH_STEP, round((config["intermediate_size"] + extra / per_width) / WIDTH_STEP) * WIDTH_STEP)
    return make_model(benchmark_cache_dir() / f"dense-llama-mlp-{width}", "llama", "30m", intermediate_size=width)


def batch1_gbps(folders: dict[str, Path], dtype: str, repeats: int) -> dict[str, float]:
    """Each model's batch-1 GB/s of the weights a token reads, the engines taking turns (best of `repeats`)."""
    speeds = batch1_turns({name: {"model": str(folder), "dtype": dtype} for name, folder in folders.items()}, repeats)
    return {name: speeds[name] * per_token_cost(folder)[0] / 1e9 for name, folder in folders.items()}


def beyond_cache_moe(cache: int) -> Path:
    """qwen3_moe at the beyond-cache llama's width, experts a quarter of its MLP wide (2 of 8 a token), with layers
    until the bf16 bytes a token reads are BEYOND_CACHE_FACTOR x `cache`, made once."""
    hidden, inter = BEYOND_CACHE_HIDDEN, BEYOND_CACHE_INTERMEDIATE // 4
    per_layer = 2 * (4 * hidden * hidden + 2 * 3 * inter * hidden)  # attention and two experts, bf16
    layers = max(1, math.ceil(BEYOND_CACHE_FACTOR * cache / per_layer))
    shape = {"hidden_size": hidden, "intermediate_size": BEYOND_CACHE_INTERMEDIATE, "moe_intermediate_size": inter,
             "num_hidden_layers": layers, "num_attention_heads": BEYOND_CACHE_HEADS,
             "num_key_value_heads": BEYOND_CACHE_HEADS, "head_dim": hidden // BEYOND_CACHE_HEADS}
    return make_model(benchmark_cache_dir() / f"beyond-cache-qwen3_moe-{layers}", "qwen3_moe", "100m", **shape)


def beyond_cache(dtype: str, repeats: int) -> None:
    cache = last_level_cache_bytes()
    moe, dense = beyond_cache_moe(cache), beyond_cache_model(cache)
    gbps = batch1_gbps({"moe": moe, "dense": dense}, dtype, repeats)
    print(f"beyond the last-level cache ({cache / 2**20:.0f} MiB): qwen3_moe ({moe.name}, "
          f"{per_token_cost(moe)[0] / 1e9:.2f} GB a token of {weight_elements(moe) * 2 / 1e9:.2f} GB) "
          f"{gbps['moe']:6.2f} GB/s | dense llama ({dense.name}, {per_token_cost(dense)[0] / 1e9:.2f} GB a token) "
          f"{gbps['dense']:6.2f} GB/s: {gbps['moe'] / gbps['dense']:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=MOE_FAMILIES, default=list(MOE_FAMILIES))
    parser.add_argument("--beyond-cache", action="store_true", help="a mixture of experts beyond the cache instead")
    args = arguments_with_kernels(parser)
    print(f"native bf16: {cpu_has_native_bf16()}, dtype {args.dtype}; batch 1 = 128 tokens; best of {args.repeats}; "
          "a quiet machine is assumed", flush=True)
    if args.beyond_cache:
        beyond_cache(args.dtype, args.repeats)
        return
    for family in args.rows:
        folder = model_dir(family)
        dense = dense_reference(folder)
        gbps = batch1_gbps({"llama": model_dir("llama"), family: folder, "dense": dense}, args.dtype, args.repeats)
        mb = weight_elements(folder) * 2 / 1e6
        print(f"{family:>12} ({mb:5.0f} MB of {args.dtype}): {gbps[family]:6.2f} GB/s | plain llama "
              f"({weight_elements(model_dir('llama')) * 2 / 1e6:.0f} MB) {gbps['llama']:6.2f} GB/s: "
              f"{gbps[family] / gbps['llama']:.2f}x | dense llama of equal bytes ({dense.name}, "
              f"{weight_elements(dense) * 2 / 1e6:.0f} MB) {gbps['dense']:6.2f} GB/s: "
              f"{gbps[family] / gbps['dense']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
