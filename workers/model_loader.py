"""Build a model in the target dtype and fill it from the folder's safetensors files."""
from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from kernels import kv_quant
from workers.cpu_allocator import gather_parameters_in_huge_pages
from workers.layers.attention import Attention
from workers.layers.fused_moe import expert_target
from workers.layers.linear import Sliceable
from workers.models import get_model_class
from workers.prepacking import prepack_linear_weights
from workers.quantization import checkpoint_format, quantize_model
from workers.quantization.formats import CheckpointFormat
from workers.quantization.gguf import GGUFCheckpoint, is_gguf
from workers.quantization.quantized_layers import holds_quantized, load_quantized

# Integer and fp8 storage (torch and safetensors names): never a plain weight's values.
QUANTIZED_STORAGE = frozenset({"int8", "uint8", "int32", "float8_e4m3fn", "float8_e5m2",
                               "I8", "U8", "I32", "F8_E4M3", "F8_E5M2"})


# Dummy weights: small enough that 80 random layers keep activations finite in bfloat16.
DUMMY_STD = 0.02


def load_model(model_path: str, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None, quantize_lm_head: bool = False,
               load_format: str = "auto", build: Callable[[PretrainedConfig], nn.Module] | None = None) -> nn.Module:
    """The model of a folder of safetensors files or of a GGUF file, its weights loaded (or random, when
    `load_format` is "dummy"; then quantized when an online `quantization` asks). build: another module of the
    folder's weights than the config's architecture (a proposer's layer)."""
    with _default_dtype(dtype), torch.device(device):
        model = (build or get_model_class(config))(config)
    if load_format == "dummy":
        if checkpoint_format(config, quantization) is not None:
            raise ValueError(f"model {model_path!r}: dummy weights are plain weights; the config's "
                             "quantization_config names a quantized checkpoint")
        fill_dummy_weights(model)
    elif is_gguf(model_path):
        gguf = GGUFCheckpoint(model_path, config)
        load_weights(model, model_path, {name: gguf for name in gguf.keys()}, gguf)
    else:
        with _safetensors_readers(model_path) as readers:
            load_weights(model, model_path, readers, checkpoint_format(config, quantization))
    quantize_model(model, config, quantization, quantize_lm_head)
    if device.type == "cpu":
        gather_parameters_in_huge_pages(model)
    prepack_linear_weights(model)
    return model.eval()


@torch.no_grad()
def fill_dummy_weights(model: nn.Module) -> None:
    """Random weights: norms' scales 1, everything else normal(0, DUMMY_STD). Each tensor's generator is seeded by
    its name, so every tensor-parallel rank draws the same values for the tensors they all hold whole."""
    for name, param in model.named_parameters():
        if param.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            continue  # integer bookkeeping a layer keeps as a parameter
        if "norm" in name and name.endswith("weight"):
            param.fill_(1.0)
            continue
        generator = torch.Generator(device=param.device).manual_seed(zlib.crc32(name.encode()))
        param.normal_(0.0, DUMMY_STD, generator=generator)


@contextlib.contextmanager
def _safetensors_readers(model_dir: str):
    """Each tensor name of the folder's *.safetensors files → the open file holding it."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model {model_dir!r} has no *.safetensors weight files")
    with contextlib.ExitStack() as stack:
        yield {name: reader for reader in (stack.enter_context(safe_open(str(f), framework="pt")) for f in files)
               for name in reader.keys()}


def load_weights(model: nn.Module, source: str, readers: dict, quantized: CheckpointFormat | None = None) -> None:
    """Copy each checkpoint tensor this rank holds into its parameter (merged projections take their part,
    TP-parallel ones their rank's shard); a safetensors slice reads only the bytes a parameter indexes. A
    quantized checkpoint's modules load in its format's storage first (workers.quantization)."""
    params = dict(model.named_parameters())
    missing = set(params)
    consumed = _load_quantized_modules(model, readers, quantized, params, missing) if quantized else set()
    for name, reader in readers.items():
        target = None if name in consumed else checkpoint_target(name, params, model)
        if target is None:
            continue
        param_name, shard_id = target
        _load_into(params[param_name], reader.get_slice(name), shard_id)
        missing.discard(param_name)
    if missing:
        raise ValueError(f"model {source!r}: checkpoint lacks weights for {sorted(missing)[:8]}")
    load_kv_scales(model, readers)


def load_kv_scales(model: nn.Module, readers: dict) -> None:
    """The checkpoint's fp8 KV cache scales (kernels.kv_quant.scale_target: k_scale, v_scale, kv_scale) onto the
    attention of the decoder layer each names; layers without one keep 1.0. Read only by an fp8 cache."""
    attention_of: dict[int, list[Attention]] = {}
    for name, module in model.named_modules():
        index = kv_quant.layer_index(name)
        if isinstance(module, Attention) and index is not None:
            attention_of.setdefault(index, []).append(module)
    for name, reader in readers.items():
        target = kv_quant.scale_target(name)
        if target is None:
            continue
        index, which = target
        scale = kv_quant.checked_scale(reader.get_tensor(name), name)
        for attention in attention_of.get(index, []):
            for kind in which:
                setattr(attention, f"{kind}_scale", scale)


def _load_quantized_modules(model: nn.Module, readers: dict, quantized: CheckpointFormat, params: dict,
                            missing: set[str]) -> set[str]:
    """Load every quantized module of the checkpoint; the names of the tensors they consumed. A module whose layer
    computes only with plain weights (a router, experts, embeddings) is dequantized into it."""
    names = set(readers)
    modules = sorted({m for m in map(quantized.quantized_module, names) if m is not None})
    if not modules and quantized.name != "gguf":  # a GGUF file may hold no Q8_0 tensor
        raise ValueError(f"the checkpoint's quantization_config names {quantized.name}, but none of its tensors is "
                         "stored that way")
    consumed: set[str] = set()
    for module in modules:
        tensor_names = quantized.module_tensors(module, names)
        consumed.update(tensor_names)
        target = checkpoint_target(module + ".weight", params, model)
        if target is None:
            continue
        part = quantized.convert(module, {n[len(module) + 1:]: readers[n].get_tensor(n) for n in tensor_names})
        param_name, shard_id = target
        layer = model.get_submodule(param_name.rpartition(".")[0])
        if param_name.endswith(".weight") and holds_quantized(layer):
            load_quantized(layer, part, shard_id)
        else:
            _load_into(params[param_name], part.dequantized().to(params[param_name].dtype), shard_id)
        missing.discard(param_name)
    return consumed


def _load_into(param: nn.Parameter, loaded: Sliceable, shard_id: int | tuple[int, int] | None) -> None:
    if param.is_floating_point() and _stored_dtype(loaded) in QUANTIZED_STORAGE:
        raise ValueError(f"a checkpoint tensor of {_stored_dtype(loaded)} values would load into a "
                         f"{param.dtype} weight with no quantization scales (missing weight_scale / scales, or a "
                         "quantization_config that does not describe this checkpoint)")
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, loaded, shard_id)
        return
    tensor = loaded[:]
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(tensor)


def checkpoint_target(name: str, params: dict, model: nn.Module) -> tuple[str, int | tuple[int, int] | None] | None:
    """Checkpoint name → (parameter name, shard id); None for tensors this rank does not use (rotary buffers,
    other pipeline stages' layers). The model may declare `checkpoint_prefixes` (name prefixes → ours, applied first),
    `weight_aliases` (names loaded into another parameter),
    `renamed_modules` (checkpoint module names → ours), `expert_modules` (per-expert projections → stacked
    parameters, see workers.layers.fused_moe) and `packed_modules` (projections merged into one parameter)."""
    aliases: dict[str, str] = getattr(model, "weight_aliases", {})
    renamed: dict[str, str] = getattr(model, "renamed_modules", {})
    experts: dict[str, tuple[str, int]] = getattr(model, "expert_modules", {})
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    for source, ours in getattr(model, "checkpoint_prefixes", {}).items():
        if name.startswith(source):
            name = ours + name[len(source):]
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


def _stored_dtype(loaded: Sliceable) -> str:
    return str(loaded.dtype).removeprefix("torch.") if isinstance(loaded, torch.Tensor) else loaded.get_dtype()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
