"""What a decoded token costs a model (the weight bytes it reads, its products' FLOPs) and the reference llamas sized
against the CPU's caches that the benchmarks hold mixtures of experts and quantized weights to."""
from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from neighbour import model_dir  # noqa: E402

from launch.make_model import benchmark_cache_dir, make_model  # noqa: E402

# --int8-beyond-cache's llama: layers of this width (multi-head attention) until its int8 weights are
# BEYOND_CACHE_FACTOR times the last-level cache.
BEYOND_CACHE_HIDDEN, BEYOND_CACHE_INTERMEDIATE, BEYOND_CACHE_HEADS, BEYOND_CACHE_FACTOR = 2048, 5632, 16, 1.5
EMBEDDING_NAMES = ("embed_tokens.weight", "embed_in.weight", "wte.weight")
POSITION_NAMES = ("embed_positions.weight", "wpe.weight")  # learned positions: a row looked up, no product
WIDTH_STEP = 64  # dense_reference's intermediate size is a multiple of this


def per_token_cost(folder: Path, every_expert: bool = False) -> tuple[float, float]:
    """(bytes of the weights a decoded token reads, FLOPs of its products) from the checkpoint's tensors; with
    `every_expert`, a mixture's every expert counted (the issue's table's normalisation)."""
    with safe_open(str(folder / "model.safetensors"), "pt") as tensors:
        shapes = {name: tensors.get_slice(name).get_shape() for name in tensors.keys()}
    return weights_cost(json.loads((folder / "config.json").read_text()), shapes, every_expert)


def weights_cost(config: dict, shapes: dict[str, Sequence[int]], every_expert: bool = False) -> tuple[float, float]:
    """per_token_cost of a model with this config and these weights' shapes (by name)."""
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    routed = config.get("num_experts_per_tok", 1) / experts if experts and not every_expert else 1.0
    read = products = 0.0
    tied = not any(name.endswith(("lm_head.weight", "embed_out.weight")) for name in shapes)
    for name, shape in shapes.items():
        elements = float(math.prod(shape))
        if (name.endswith(EMBEDDING_NAMES) and not tied) or name.endswith(POSITION_NAMES):
            continue
        if ".experts." in name and ".shared_expert" not in name:
            elements *= routed
        read += elements * 2  # bytes of bf16
        products += 2 * elements if len(shape) == 2 else 0
    return read, products


def is_mixture_of_experts(folder: Path) -> bool:
    """Whether a decoded token reads only some of the model's weights (its top-k of the routed experts)."""
    return per_token_cost(folder, every_expert=True)[0] != per_token_cost(folder)[0]


def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs lists (cpu0's), in bytes; 0 where it lists none."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]] if text[-1].isalpha()
                     else int(text))
    return max(sizes, default=0)


def beyond_cache_model(cache: int) -> Path:
    """A llama whose int8 weights (one byte each) are BEYOND_CACHE_FACTOR x `cache` bytes, made once."""
    hidden, inter = BEYOND_CACHE_HIDDEN, BEYOND_CACHE_INTERMEDIATE
    layers = max(1, math.ceil(BEYOND_CACHE_FACTOR * cache / (4 * hidden * hidden + 3 * inter * hidden)))
    shape = {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
             "num_attention_heads": BEYOND_CACHE_HEADS, "num_key_value_heads": BEYOND_CACHE_HEADS}
    return make_model(benchmark_cache_dir() / f"beyond-cache-llama-{layers}", "llama", "100m", **shape)


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
