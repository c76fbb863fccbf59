"""Decoder layers of each mixture-of-experts family at the model maker's 30m size against llama's, in the C++
layer (kernels.cpu_decoder_layer), bf16: microseconds per call at 1 and 32 tokens and the layer's share of llama's
speed normalised by the bytes a token reads (1 token: the routed experts' share) and the FLOPs of its products
(32 tokens), as benchmarks/feature_speed.py normalises whole models. The families' calls take turns (best of TURNS
turns of --rounds calls each), so that the host's drift hits them alike.

    python benchmarks/moe_fused_layer.py [--rows 1 32] [--rounds 100] [--layers 8] [--cpu-time] [--no-expert-pairs]
                                         [--vary-routing]

--layers: that many layers of distinct weights per call, so the weights a step reads outgrow the caches as a
model's do. --cpu-time: one thread, timed by its CPU time (time.thread_time), which other processes' load moves
less than wall time: the work a layer does, for comparing kernels on a busy machine (not how threads share it).
--no-expert-pairs: the experts without their paired copies (torch's products past their weights' rows).
--vary-routing: each call's input one of VARIED_INPUTS, so that its experts change from call to call as a model's
do from token to token (by default every call routes the same input to the same experts, which then stay cached).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from neighbour import alternating_best  # noqa: E402

from kernels import cpu_decoder_layer, cpu_extension, cpu_gemv  # noqa: E402
from launch.model_shapes import SIZES, config_kwargs  # noqa: E402
from workers.layers.rotary import RotaryEmbedding, rope_parameters_of  # noqa: E402
from workers.models.llama import LlamaDecoderLayer, head_dim_of  # noqa: E402
from workers.models.mixtral import MixtralDecoderLayer  # noqa: E402
from workers.models.qwen2_moe import Qwen2MoeDecoderLayer  # noqa: E402
from workers.models.qwen3_moe import Qwen3MoeDecoderLayer  # noqa: E402
from workers.prepacking import prepack_linear_weights  # noqa: E402

FAMILIES = {"llama": LlamaDecoderLayer, "mixtral": MixtralDecoderLayer, "qwen2_moe": Qwen2MoeDecoderLayer,
            "qwen3_moe": Qwen3MoeDecoderLayer}
CONTEXT = 96  # each row's sequence length
VARIED_INPUTS = 64  # --vary-routing: inputs taken in turn
TURNS = 5  # timed turns of --rounds calls each family takes (after one untimed)


def config_of(arch: str) -> PretrainedConfig:
    return AutoConfig.for_model(arch, **config_kwargs(arch, SIZES["30m"], 8192))


def make_layer(arch: str, config: PretrainedConfig, expert_pairs: bool, seed: int) -> LlamaDecoderLayer:
    """A bf16 layer of random weights with its paired (and prepacked) copies, as a loaded model keeps them."""
    generator = torch.Generator().manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters_of(config))
        layer = FAMILIES[arch](config, 0, rotary)
    finally:
        torch.set_default_dtype(previous)
    for name, param in layer.named_parameters():
        param.data.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(param.shape, generator=generator))
    prepack_linear_weights(layer, available_bytes=1 << 40)
    if not expert_pairs and hasattr(layer.mlp, "experts"):
        layer.mlp.experts.gate_up_pairs = layer.mlp.experts.down_pairs = None
    return layer


def per_token_cost(layer: LlamaDecoderLayer) -> tuple[float, float]:
    """(bytes a token reads, FLOPs of its products): the routed experts counted at their top_k share."""
    read = products = 0.0
    for name, param in layer.named_parameters():
        elements = float(param.numel())
        if ".experts." in name:
            elements *= layer.mlp.experts.routing.top_k / layer.mlp.experts.num_experts
        read += 2 * elements
        products += 2 * elements if param.dim() >= 2 else 0
    return read, products


@torch.inference_mode()
def layers_call(layers: list[LlamaDecoderLayer], config: PretrainedConfig, rows: int, inputs: int = 1
                ) -> tuple[Callable[[], None], bool]:
    """A call of the C++ layers over `rows` decodes (torch's products past their max_rows), the calls taking `inputs`
    inputs in turn (each copied in first, as the layers write their input); and whether the kernels' products run."""
    head_dim, kv_heads = head_dim_of(config), config.num_key_value_heads
    blocks_per_seq = -(-CONTEXT // 16)
    cache = [torch.randn(rows * blocks_per_seq + 1, kv_heads, 16, head_dim).bfloat16() for _ in range(2)]
    tables = torch.arange(rows * blocks_per_seq).view(rows, blocks_per_seq)
    positions = torch.full((rows,), CONTEXT - 1)
    slots = tables[:, -1] * 16 + (CONTEXT - 1) % 16
    xs = itertools.cycle([torch.randn(rows, config.hidden_size).bfloat16() for _ in range(inputs)])
    x, residual = torch.empty(rows, config.hidden_size).bfloat16(), torch.empty(rows, config.hidden_size).bfloat16()
    step = cpu_decoder_layer.decode_step(x, positions, slots, tables, list(range(rows + 1)),
                                         min(layer.fused_weights.max_rows() for layer in layers))
    prepared = cpu_decoder_layer.PreparedLayers([layer.fused_weights for layer in layers], [tuple(cache)] * len(layers),
                                                torch.bfloat16)

    @torch.inference_mode()
    def run() -> None:
        x.copy_(residual.copy_(next(xs)))
        if step.kernel_products:
            cpu_decoder_layer.decoder_layers(prepared, x, residual, step)
        else:
            cpu_decoder_layer.decoder_layers_with_products(prepared, [layer.fused_products for layer in layers], x,
                                                           residual, step)
    return run, step.kernel_products


def calls_of(call: Callable[[], None], rounds: int) -> Callable[[], int]:
    """`rounds` calls in a row, as one timed run of neighbour.alternating_best (which counts what it returns)."""
    def run() -> int:
        for _ in range(rounds):
            call()
        return rounds
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--layers", type=int, default=1, help="layers per call (distinct weights, as a model's)")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    parser.add_argument("--no-expert-pairs", action="store_true", help="the experts' products from their weights")
    parser.add_argument("--vary-routing", action="store_true", help="inputs that change the experts call to call")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    if cpu_extension.load() is None:
        raise SystemExit("the C++ CPU kernels did not build")
    print(f"native bf16 pairs: {cpu_gemv.pairs_cpu()}; {torch.get_num_threads()} threads; families in turns")
    families = ["llama", *(f for f in args.families if f != "llama")]
    models = {}
    for arch in families:
        config = config_of(arch)
        models[arch] = config, [make_layer(arch, config, not args.no_expert_pairs, seed) for seed in range(args.layers)]
    parts: dict[str, list[str]] = {arch: [] for arch in families}
    for rows in args.rows:
        calls = {arch: layers_call(layers, config, rows, VARIED_INPUTS if args.vary_routing else 1)
                 for arch, (config, layers) in models.items()}
        per_second = alternating_best({arch: calls_of(call, args.rounds) for arch, (call, _) in calls.items()},
                                      TURNS, clock=time.thread_time if args.cpu_time else time.perf_counter)
        speeds = {}
        for arch, (config, layers) in models.items():
            read, flops = per_token_cost(layers[0])
            micros = 1e6 / per_second[arch] / len(layers)
            speeds[arch] = (read if rows == 1 else flops) * rows / micros
            parts[arch].append(f"{rows:3d} rows {micros:8.1f} us {'kernel' if calls[arch][1] else 'torch '} "
                               f"({speeds[arch] / speeds['llama']:.2f}x)")
    for arch in families:
        print(f"{arch:>10}: " + " | ".join(parts[arch]), flush=True)


if __name__ == "__main__":
    main()
