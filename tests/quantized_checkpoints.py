"""Quantized test checkpoints and their dequantized references, made from a random-weight model folder.

compressed-tensors checkpoints are made and decompressed by the compressed-tensors library itself (the format's
reference). GPTQ and AWQ checkpoints are packed here from the formats' specifications (AutoGPTQ's v1 layout,
AutoAWQ's GEMM layout); no reference packer installs on a CPU-only machine. Each maker writes the quantized folder
and a float32 folder holding the weights the quantized ones stand for, which HF transformers runs as the reference.
"""
from __future__ import annotations

import functools
import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from conftest import _MODEL_ROOT, tiny_model
from launch.fp8_blocks import fp8_block_checkpoint  # noqa: F401 (the tests' maker of that format)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def hf_model(source: str):
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore")
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)


def copy_tokenizer(source: str, folder: Path) -> None:
    for file in Path(source).glob("tokenizer*"):
        shutil.copy(file, folder / file.name)


def fresh_folder(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def compressed_tensors_checkpoint(source: str, folder: Path, weights: dict, form: str) -> tuple[str, str]:
    """(quantized folder, reference folder) for a compressed-tensors scheme (`weights`: QuantizationArgs fields)
    saved in `form` (pack-quantized, int-quantized, float-quantized); lm_head stays unquantized."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = hf_model(source)
    args = QuantizationArgs(**weights)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                _observe(module, args, calculate_qparams)
    compressor = ModelCompressor.from_pretrained_model(model, form)
    compressor.compress_model(model)
    quantized = fresh_folder(folder / "quantized")
    model.save_pretrained(quantized)
    compressor.update_config(str(quantized))
    compressor.decompress_model(model)  # the library's own dequantization is the reference
    reference = save_plain(model, folder / "reference")
    for out in (quantized, reference):
        copy_tokenizer(source, out)
    return str(quantized), str(reference)


def _observe(module: torch.nn.Module, args, calculate_qparams) -> None:
    """Min-max scales (and zero points) of the module's weight for its strategy."""
    weight = module.weight
    if args.strategy == "group":
        grouped = weight.view(weight.shape[0], -1, args.group_size)
        low, high = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "block":
        rows, columns = args.block_structure
        blocks = weight.view(weight.shape[0] // rows, rows, weight.shape[1] // columns, columns)
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    elif args.strategy == "channel":
        low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    else:
        low, high = weight.amin().reshape(1), weight.amax().reshape(1)
    scale, zero = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def save_plain(model, folder: Path) -> Path:
    """The model's float weights (as now in memory) with no quantization left in its config."""
    folder = fresh_folder(folder)
    state = {name: tensor.detach().float().clone() for name, tensor in model.state_dict().items()
             if name.endswith(("weight", "bias")) and tensor.is_floating_point()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _group_qparams(weight: torch.Tensor, columns: torch.Tensor, bits: int, symmetric: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max (scale, integer zero) [N] of the weight's given columns, for unsigned `bits`-bit values."""
    part = weight[:, columns]
    top = (1 << bits) - 1
    if symmetric:
        scale = part.abs().amax(1).clamp(min=1e-8) / ((top - 1) / 2)
        return scale, torch.full_like(scale, (top + 1) // 2)
    low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
    scale = ((high - low) / top).clamp(min=1e-8)
    return scale, torch.round(-low / scale).clamp(0, top)


def _quantize_groups(weight: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, symmetric: bool):
    """Unsigned q [N, K], scales [G, N] (float16, as the formats store them), zeros [G, N] and the dequantized
    weight (float32, from the stored scales)."""
    scales, zeros = [], []
    for group in range(groups):
        scale, zero = _group_qparams(weight, (g_idx == group).nonzero().squeeze(1), bits, symmetric)
        scales.append(scale.half())
        zeros.append(zero)
    scales_t, zeros_t = torch.stack(scales), torch.stack(zeros)
    scale_k, zero_k = scales_t.float()[g_idx].t(), zeros_t[g_idx].t()
    q = torch.round(weight / scale_k + zero_k).clamp(0, (1 << bits) - 1)
    return q.to(torch.int32), scales_t, zeros_t.to(torch.int32), (q - zero_k) * scale_k


def _pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned values packed into int32 along `dim`, value i of each word at bits i * bits (in `order`)."""
    per_word = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    words = moved.reshape(*moved.shape[:-1], -1, per_word)
    if order is not None:
        words = words[..., list(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    packed = (words << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def gptq_checkpoint(source: str, folder: Path, bits: int, group_size: int, act_order: bool,
                    symmetric: bool = False) -> tuple[str, str]:
    """A GPTQ (v1 `gptq` layout) checkpoint and its reference. Act-order: each layer's columns are taken in a
    random order and grouped in that order, so g_idx is a real permutation's."""
    return _integer_checkpoint(source, folder, "gptq", bits, group_size, act_order, symmetric)


def awq_checkpoint(source: str, folder: Path, group_size: int) -> tuple[str, str]:
    """An AWQ (GEMM layout, 4-bit, zero points) checkpoint and its reference."""
    return _integer_checkpoint(source, folder, "awq", 4, group_size, False, False)


def _input_of(name: str) -> str:
    parent, leaf = name.rsplit(".", 1)
    return name if leaf in ("o_proj", "down_proj") else parent + (".qkv" if leaf in LINEARS[:3] else ".gate_up")


def _integer_checkpoint(source: str, folder: Path, method: str, bits: int, group_size: int, act_order: bool,
                        symmetric: bool) -> tuple[str, str]:
    model = hf_model(source)
    generator = torch.Generator().manual_seed(bits * 100 + group_size)
    tensors: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}  # GPTQ orders columns by their input's statistics: q/k/v alike, gate/up alike
    with torch.no_grad():
        for name, module in model.named_modules():
            if not name.endswith(LINEARS):
                continue
            weight = module.weight.float()
            columns = weight.shape[1]
            order = orders.setdefault(_input_of(name), torch.randperm(columns, generator=generator)) if act_order \
                else torch.arange(columns)
            g_idx = torch.empty(columns, dtype=torch.int64)
            g_idx[order] = torch.arange(columns) // group_size
            q, scales, zeros, dequantized = _quantize_groups(weight, g_idx, -(-columns // group_size), bits,
                                                             symmetric)
            module.weight.copy_(dequantized)
            if method == "gptq":
                tensors[f"{name}.qweight"] = _pack(q.t(), bits, dim=0)
                tensors[f"{name}.qzeros"] = _pack(zeros - 1, bits, dim=1)  # v1 stores zero - 1
                tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
            else:
                tensors[f"{name}.qweight"] = _pack(q.t(), bits, dim=1, order=AWQ_PACK_ORDER)
                tensors[f"{name}.qzeros"] = _pack(zeros, bits, dim=1, order=AWQ_PACK_ORDER)
            tensors[f"{name}.scales"] = scales
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias.detach().float()
    reference = save_plain(model, folder / "reference")
    quantized = fresh_folder(folder / "quantized")
    state = {n: t.detach().float().clone() for n, t in model.state_dict().items()
             if not n.rsplit(".", 2)[-2].endswith(LINEARS)}
    save_file({**state, **tensors}, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": symmetric,
         "checkpoint_format": "gptq"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"})
    (quantized / "config.json").write_text(json.dumps(config))
    for out in (quantized, reference):
        copy_tokenizer(source, out)
    return str(quantized), str(reference)


def gguf_reference(path: str, tokenizer: str, folder: Path) -> str:
    """A float32 folder of what HF transformers reads from the GGUF file (its own name mapping, q/k reordering and
    dequantization through the gguf package): the reference the engine's GGUF loading must equal."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    warnings.filterwarnings("ignore")
    config = AutoConfig.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({name: tensor.float() for name, tensor in tensors.items()}, strict=False)
    model.tie_weights()
    model.config.architectures = [type(model).__name__]
    reference = save_plain(model, folder)
    copy_tokenizer(tokenizer, reference)
    return str(reference)


INT4_GROUP = dict(num_bits=4, type="int", strategy="group", group_size=16)
CHECKPOINTS = {
    "ct-w4a16-asymmetric": lambda src, out: compressed_tensors_checkpoint(
        src, out, {**INT4_GROUP, "symmetric": False}, "pack-quantized"),
    "ct-w4a16": lambda src, out: compressed_tensors_checkpoint(
        src, out, {**INT4_GROUP, "symmetric": True, "group_size": 32}, "pack-quantized"),
    "ct-w8a16": lambda src, out: compressed_tensors_checkpoint(
        src, out, dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized"),
    "ct-int8-tensor": lambda src, out: compressed_tensors_checkpoint(
        src, out, dict(num_bits=8, type="int", symmetric=True, strategy="tensor"), "int-quantized"),
    "ct-fp8": lambda src, out: compressed_tensors_checkpoint(
        src, out, dict(num_bits=8, type="float", symmetric=True, strategy="channel"), "float-quantized"),
    "ct-fp8-block": lambda src, out: compressed_tensors_checkpoint(
        src, out, dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[16, 32]),
        "float-quantized"),
    "gptq-4bit": lambda src, out: gptq_checkpoint(src, out, 4, 16, act_order=False),
    "gptq-4bit-act-order": lambda src, out: gptq_checkpoint(src, out, 4, 16, act_order=True),
    "gptq-8bit-act-order-symmetric": lambda src, out: gptq_checkpoint(src, out, 8, 32, act_order=True,
                                                                      symmetric=True),
    "awq": lambda src, out: awq_checkpoint(src, out, 16),
}


@functools.cache
def checkpoint(kind: str, arch: str = "llama") -> tuple[str, str]:
    """(quantized folder, float32 reference folder), made once per session."""
    return CHECKPOINTS[kind](tiny_model(arch), _MODEL_ROOT / f"{arch}-tiny-{kind}")
