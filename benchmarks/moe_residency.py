"""Mixtures of experts at batch 1 against a dense llama of the same total weight bytes: is a row's share the cache's?

benchmarks/feature_speed.py normalises a mixture of experts' batch-1 speed by the bytes a token reads (its top-k
experts' share), as a share of plain llama's GB/s. But a token's experts change from token to token, so the bytes
that must stay cached are all experts', not a token's: a model whose weights outgrow what the caches hold streams
them more slowly, dense or not. This measures, in one run, each family's batch-1 GB/s, plain llama's, and that of a
dense llama (the same hidden size and layers) whose MLP is widened until its weights total the family's: the last
is what plain llama's own fast path reaches on a working set of that size.

--beyond-cache instead: each family (--rows) at feature_speed's beyond-cache llama's width, heads and MLP width (its
experts as the model maker shapes them: a quarter of that MLP wide, Mixtral's as wide), with layers until the bytes
a token reads are BEYOND_CACHE_FACTOR x the last-level cache, against that beyond-cache llama: both stream from
memory, as real models do, where a mixture of experts' switching experts no longer meet weights that stay cached.

    python benchmarks/moe_residency.py [--rows mixtral deepseek_v2 ...] [--repeats 5] [--beyond-cache]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from feature_speed import arguments_with_kernels, batch1_turns  # noqa: E402
from neighbour import model_dir  # noqa: E402
from residency import (BEYOND_CACHE_FACTOR, BEYOND_CACHE_HEADS, BEYOND_CACHE_HIDDEN,  # noqa: E402
                       BEYOND_CACHE_INTERMEDIATE, beyond_cache_model, dense_reference, last_level_cache_bytes,
                       per_token_cost, weight_elements, weights_cost)

from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from launch.make_model import benchmark_cache_dir, make_model, quiet_transformers  # noqa: E402
from launch.model_shapes import SIZES, SizeSpec, config_kwargs, family_kwargs  # noqa: E402

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
BEYOND_CACHE_KV_BYTES = 1 << 28


def batch1_gbps(folders: dict[str, Path], dtype: str, repeats: int, **engine) -> dict[str, float]:
    """Each model's batch-1 GB/s of the weights a token reads, the engines taking turns (best of `repeats`); `engine`:
    more engine arguments."""
    speeds = batch1_turns({name: {"model": str(folder), "dtype": dtype, **engine} for name, folder in folders.items()},
                          repeats)
    return {name: speeds[name] * per_token_cost(folder)[0] / 1e9 for name, folder in folders.items()}


def beyond_cache_moe(family: str, cache: int) -> Path:
    """`family` at the beyond-cache llama's width, heads and MLP width, its experts as the model maker shapes them
    for that MLP (a quarter as wide but Mixtral's), with layers until the bf16 bytes a token reads are
    BEYOND_CACHE_FACTOR x `cache`, made once."""
    width = SizeSpec(BEYOND_CACHE_HIDDEN, 1, BEYOND_CACHE_HEADS, BEYOND_CACHE_HEADS, BEYOND_CACHE_INTERMEDIATE,
                     max_positions=2048, vocab=8192, sliding_window=512)
    shape = family_kwargs(family, width) | {
        "hidden_size": width.hidden, "intermediate_size": width.intermediate, "num_attention_heads": width.heads,
        "num_key_value_heads": width.kv_heads}
    first = shape.get("first_k_dense_replace", 0) + 1  # layers up to the first mixture of experts
    up_to_first = token_bytes(family, shape, first)
    per_layer = token_bytes(family, shape, first + 1) - up_to_first
    layers = first + max(0, math.ceil((BEYOND_CACHE_FACTOR * cache - up_to_first) / per_layer))
    return make_model(benchmark_cache_dir() / f"beyond-cache-{family}-{layers}", family, "100m", **shape,
                      num_hidden_layers=layers)


def token_bytes(family: str, shape: dict, layers: int) -> float:
    """The bf16 bytes a token reads in `family` of this shape and layers (its weights' shapes on the meta device)."""
    config = AutoConfig.for_model(family, **config_kwargs(family, SIZES["100m"], 8192) | shape
                                  | {"num_hidden_layers": layers})
    with quiet_transformers(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return weights_cost(config.to_dict(), {name: tuple(w.shape) for name, w in model.state_dict().items()})[0]


def beyond_cache(families: list[str], dtype: str, repeats: int) -> None:
    cache = last_level_cache_bytes()
    dense = beyond_cache_model(cache)
    for family in families:
        moe = beyond_cache_moe(family, cache)
        # A KV budget of its own: beside another engine's GBs of weights, the default (a share of the memory free
        # at load) fell below one context for DeepSeek's.
        gbps = batch1_gbps({"moe": moe, "dense": dense}, dtype, repeats, kv_cache_memory=BEYOND_CACHE_KV_BYTES)
        print(f"beyond the last-level cache ({cache / 2**20:.0f} MiB): {family:>11} ({moe.name}, "
              f"{per_token_cost(moe)[0] / 1e9:.2f} GB a token of {weight_elements(moe) * 2 / 1e9:.2f} GB) "
              f"{gbps['moe']:6.2f} GB/s | dense llama ({dense.name}, {per_token_cost(dense)[0] / 1e9:.2f} GB a "
              f"token) {gbps['dense']:6.2f} GB/s: {gbps['moe'] / gbps['dense']:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=MOE_FAMILIES, default=list(MOE_FAMILIES))
    parser.add_argument("--beyond-cache", action="store_true", help="a mixture of experts beyond the cache instead")
    args = arguments_with_kernels(parser)
    print(f"native bf16: {cpu_has_native_bf16()}, dtype {args.dtype}; batch 1 = 128 tokens; best of {args.repeats}; "
          "a quiet machine is assumed", flush=True)
    if args.beyond_cache:
        beyond_cache(args.rows, args.dtype, args.repeats)
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
