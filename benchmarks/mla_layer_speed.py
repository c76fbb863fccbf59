"""DeepSeek-V2/V3's C++ layers (MLA, grouped routing, experts) against llama's at the model maker's 30m shapes, in
process: each stage's time per step at batch 1 and 32, and the shares feature_speed.py would give them (weight
bytes per second at batch 1, product FLOPs per second at batch 32, over llama's), without the engine around them.

    python benchmarks/mla_layer_speed.py [--layers 8] [--steps 200] [--threads 2] [--rows deepseek_v2 deepseek_v3]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_decoder_layer, cpu_extension  # noqa: E402
from launch.model_shapes import SIZES, config_kwargs  # noqa: E402
from workers.layers.rotary import RotaryEmbedding, rope_parameters_of  # noqa: E402
from workers.models.deepseek_v2 import DeepseekV2DecoderLayer  # noqa: E402
from workers.models.deepseek_v3 import DeepseekV3DecoderLayer  # noqa: E402
from workers.models.llama import LlamaDecoderLayer, head_dim_of  # noqa: E402
from workers.prepacking import prepack_linear_weights  # noqa: E402

LAYERS = {"llama": LlamaDecoderLayer, "deepseek_v2": DeepseekV2DecoderLayer, "deepseek_v3": DeepseekV3DecoderLayer}
BLOCK_SIZE = 16
CONTEXT = 128  # each sequence's length at the timed step: the benchmark's 64-token prompts halfway through


def layers_of(arch: str, count: int) -> tuple[list, object]:
    """`count` bf16 layers of the 30m shape with paired copies (the first of a DeepSeek model dense, the rest
    experts, as the model maker's), random weights near trained ones' scale."""
    config = AutoConfig.for_model(arch, **config_kwargs(arch, SIZES["30m"], 8192))
    generator = torch.Generator().manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters_of(config))
        layers = [LAYERS[arch](config, i, rotary) for i in range(count)]
    finally:
        torch.set_default_dtype(previous)
    for layer in layers:
        for name, param in layer.named_parameters():
            param.data.copy_(("norm" in name) + 0.05 * torch.randn(param.shape, generator=generator))
        prepack_linear_weights(layer, available_bytes=1 << 40)
        assert layer.takes_one_call
    return layers, config


def per_token_cost(layers: list, config) -> tuple[float, float]:
    """(weight bytes, product FLOPs) a token costs the layers, as feature_speed.py counts them."""
    routed = config.num_experts_per_tok / getattr(config, "n_routed_experts", 1) if hasattr(
        config, "n_routed_experts") else 1.0
    read = products = 0.0
    for layer in layers:
        for name, value in layer.state_dict().items():
            if value.dim() < 1 or not value.is_floating_point() or name.endswith("_pairs"):
                continue
            elements = float(math.prod(value.shape)) * (routed if ".experts." in name else 1.0)
            read += elements * 2
            products += 2 * elements if value.dim() >= 2 else 0
    return read, products


def step_of(batch: int, hidden: int, blocks_per_seq: int) -> tuple[torch.Tensor, cpu_decoder_layer.DecodeStep]:
    tables = torch.arange(batch * blocks_per_seq).reshape(batch, blocks_per_seq)
    positions = torch.full((batch,), CONTEXT - 1)
    slots = tables[:, (CONTEXT - 1) // BLOCK_SIZE] * BLOCK_SIZE + (CONTEXT - 1) % BLOCK_SIZE
    x = torch.randn(batch, hidden).to(torch.bfloat16)
    step = cpu_decoder_layer.decode_step(x, positions, slots, tables, list(range(batch + 1)), 64)
    return x, step


def seconds_per_step(layers: list, config, batch: int, steps: int) -> tuple[float, float]:
    """(best, median) seconds of one decoder_layers call over all the layers at `batch` decodes."""
    blocks_per_seq = -(-CONTEXT // BLOCK_SIZE)
    caches = []
    for layer in layers:
        attention = layer.fused_attention
        shape = (batch * blocks_per_seq, layer.fused_weights.num_kv_heads, BLOCK_SIZE, layer.fused_weights.head_dim)
        cache = (0.1 * torch.randn(shape)).to(torch.bfloat16)
        attention.kv_cache = (cache, cache) if layer.fused_weights.mla_kv_a is not None else (cache, cache.clone())
        caches.append(attention.kv_cache)
    prepared = cpu_decoder_layer.PreparedLayers([layer.fused_weights for layer in layers], caches, torch.bfloat16)
    times = []
    with torch.inference_mode():
        x, step = step_of(batch, config.hidden_size, blocks_per_seq)
        assert step.kernel_products
        for i in range(steps + 10):
            start = time.perf_counter()
            cpu_decoder_layer.decoder_layers(prepared, x, None, step)
            if i >= 10:
                times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", type=int, choices=(1, 32), help="time only this batch, only the rows (for perf)")
    parser.add_argument("--rows", nargs="+", default=["deepseek_v2", "deepseek_v3"], choices=list(LAYERS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_extension.load() is None:
        raise SystemExit("the extension did not build")
    if args.profile:
        for arch in args.rows:
            seconds_per_step(*layers_of(arch, args.layers), args.profile, args.steps)
        return
    figures = {}
    for arch in ["llama", *args.rows]:
        layers, config = layers_of(arch, args.layers)
        read, products = per_token_cost(layers, config)
        figures[arch] = (read, products, *(seconds_per_step(layers, config, batch, args.steps) for batch in (1, 32)))
    base = figures["llama"]
    for arch, (read, products, one, many) in figures.items():
        b1 = read / one[0] / (base[0] / base[2][0])
        b32 = 32 * products / many[0] / (32 * base[1] / base[3][0])
        print(f"{arch:>12}: batch 1 {one[0] * 1e3:7.3f} ms (median {one[1] * 1e3:7.3f}) share {b1:.2f} | "
              f"batch 32 {many[0] * 1e3:7.3f} ms (median {many[1] * 1e3:7.3f}) share {b32:.2f}")


if __name__ == "__main__":
    main()
