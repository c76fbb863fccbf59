"""Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) into per-module A and B matrices (the
scaling folded into B) and the full weights of `modules_to_save`; ValueError naming what is wrong with it."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from workers.lora.files import MAX_CONFIG_BYTES, MAX_WEIGHTS_BYTES, read_regular_file

PREFIX = "base_model.model."
# Modules whose full weights an adapter may replace (PEFT's modules_to_save); the engine's names for them.
SAVED_MODULES = {"lm_head": "lm_head", "embed_tokens": "model.embed_tokens"}


@dataclass
class LoRAModule:
    """delta(x) = x A^T B^T for one target module (HF name): A [r, K], B [N, r] already times the scaling."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    name: str
    int_id: int
    rank: int
    modules: dict[str, LoRAModule] = field(default_factory=dict)
    saved: dict[str, torch.Tensor] = field(default_factory=dict)  # "lm_head" / "model.embed_tokens" → weight


def read_adapter_config(path: str) -> dict:
    """The folder's adapter_config.json, checked for what the engine runs: LoRA without DoRA or trained biases."""
    folder = Path(path)
    try:
        config = json.loads(read_regular_file(folder / "adapter_config.json", MAX_CONFIG_BYTES))
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {path!r}: cannot read adapter_config.json: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not a PEFT LoRA config")
    for key, allowed, what in (("use_dora", False, "DoRA"), ("bias", "none", "trained biases"),
                               ("fan_in_fan_out", False, "fan_in_fan_out (Conv1D) weights")):
        if config.get(key, allowed) != allowed:
            raise ValueError(f"LoRA adapter {path!r}: {what} are not supported")
    return config


def load_adapter(name: str, int_id: int, path: str, max_rank: int) -> LoRAAdapter:
    """The adapter's tensors (float32, on the CPU), every rank checked against max_rank."""
    config = read_adapter_config(path)
    try:
        tensors = load_safetensors(read_regular_file(Path(path) / "adapter_model.safetensors", MAX_WEIGHTS_BYTES))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {path!r}: adapter_model.safetensors is unreadable: {exc}") from None
    adapter = LoRAAdapter(name, int_id, 0)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        key = key.removeprefix(PREFIX)
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.\w+)?\.weight", key)
        if match:
            pairs.setdefault(match.group(1), {})[match.group(2)] = tensor.float()
        elif key.removesuffix(".weight") in SAVED_MODULES.values() or key.removesuffix(".weight") in SAVED_MODULES:
            module = key.removesuffix(".weight")
            adapter.saved[SAVED_MODULES.get(module, module)] = tensor
        else:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is neither a LoRA A/B matrix nor a weight of "
                             f"{', '.join(SAVED_MODULES)} (modules_to_save)")
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: module {module!r} lacks its lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {path!r}: module {module!r} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)}, which do not multiply")
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: rank {rank} of {module!r} exceeds max_lora_rank {max_rank}")
        adapter.modules[module] = LoRAModule(a.contiguous(), (b * _scaling(config, module, rank)).contiguous())
        adapter.rank = max(adapter.rank, rank)
    if not adapter.modules and not adapter.saved:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return adapter


def _scaling(config: dict, module: str, rank: int) -> float:
    """lora_alpha / r, or / sqrt(r) with rslora; alpha_pattern may give a module its own alpha."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module):
            alpha = value
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
