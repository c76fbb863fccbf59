"""Build a model in the target dtype and fill it from the folder's safetensors files."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from workers.layers.fused_moe import expert_target
from workers.layers.linear import Sliceable
from workers.models import get_model_class
from workers.quantization import quantize_model


def load_model(model_dir: str, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None, quantize_lm_head: bool = False) -> nn.Module:
    with _default_dtype(dtype), torch.device(device):
        model = get_model_class(config)(config)
    load_weights(model, model_dir)
    quantize_model(model, quantization, quantize_lm_head)
    return model.eval()


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Copy each checkpoint tensor this rank holds into its parameter (merged projections take their part,
    TP-parallel ones their rank's shard); a safetensors slice reads only the bytes a parameter indexes."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model {model_dir!r} has no *.safetensors weight files")
    params = dict(model.named_parameters())
    missing = set(params)
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():
                target = _target_of(name, params, model)
                if target is None:
                    continue
                param_name, shard_id = target
                _load_into(params[param_name], reader.get_slice(name), shard_id)
                missing.discard(param_name)
    if missing:
        raise ValueError(f"model {model_dir!r}: checkpoint lacks weights for {sorted(missing)[:8]}")


def _load_into(param: nn.Parameter, loaded: Sliceable, shard_id: int | tuple[int, int] | None) -> None:
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, loaded, shard_id)
        return
    tensor = loaded[:]
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(tensor)


def _target_of(name: str, params: dict, model: nn.Module) -> tuple[str, int | tuple[int, int] | None] | None:
    """Checkpoint name → (parameter name, shard id); None for tensors this rank does not use (rotary buffers,
    other pipeline stages' layers). The model may declare `weight_aliases` (names loaded into another parameter),
    `renamed_modules` (checkpoint module names → ours), `expert_modules` (per-expert projections → stacked
    parameters, see workers.layers.fused_moe) and `packed_modules` (projections merged into one parameter)."""
    aliases: dict[str, str] = getattr(model, "weight_aliases", {})
    renamed: dict[str, str] = getattr(model, "renamed_modules", {})
    experts: dict[str, tuple[str, int]] = getattr(model, "expert_modules", {})
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    for candidate in (name, "model." + name):
        if aliases.get(candidate) in params:
            return aliases[candidate], None
        for source, ours in renamed.items():
            candidate = candidate.replace(f".{source}.", f".{ours}.")
        expert = expert_target(candidate, experts) if experts else None
        if expert is not None and expert[0] in params:
            return expert
        for source, (merged, shard_id) in packed.items():
            merged_name = candidate.replace(f".{source}.", f".{merged}.")
            if merged_name != candidate and merged_name in params:
                return merged_name, shard_id
        if candidate in params:
            return candidate, None
    return None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
