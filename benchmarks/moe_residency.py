"""Mixtures of experts at batch 1 against a dense llama of the same total weight bytes: is a row's share the cache's?

benchmarks/feature_speed.py normalises a mixture of experts' batch-1 speed by the bytes a token reads (its top-k
experts' share), as a share of plain llama's GB/s. But a token's experts change from token to token, so the bytes
that must stay cached are all experts', not a token's: a model whose weights outgrow what the caches hold streams
them more slowly, dense or not. This measures, in one run, each family's batch-1 GB/s, plain llama's, and that of a
dense llama (the same hidden size and layers) whose MLP is widened until its weights total the family's: the last
is what plain llama's own fast path reaches on a working set of that size.

    python benchmarks/moe_residency.py [--rows mixtral deepseek_v2 ...] [--repeats 5]
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

from feature_speed import arguments_with_kernels, batch1_turns, per_token_cost  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=MOE_FAMILIES, default=list(MOE_FAMILIES))
    args = arguments_with_kernels(parser)
    print(f"native bf16: {cpu_has_native_bf16()}, dtype {args.dtype}; batch 1 = 128 tokens; best of {args.repeats}; "
          "a quiet machine is assumed", flush=True)
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
