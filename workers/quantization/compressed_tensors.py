"""compressed-tensors checkpoints (llm-compressor's format): int weights packed in int32 (`pack-quantized`, 4 or 8
bits), int8 (`int-quantized`, `naive-quantized`) and FP8 (`float-quantized`) weights, with scales per tensor,
channel, group or block. Activation schemes (W8A8, FP8 dynamic) run weight-only here: activations stay in the
model dtype."""
from __future__ import annotations

import re
from typing import Any

import torch

from workers.quantization.formats import QuantizedTensors, config_value, to_canonical, trivial_g_idx, unpack_int32

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
WEIGHT_TENSORS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                  "input_scale", "input_zero_point", "weight_global_scale", "input_global_scale")


class CompressedTensorsFormat:
    name = "compressed-tensors"

    def __init__(self, config: Any) -> None:
        groups = config_value(config, "config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        default_format = config_value(config, "format")
        self.groups: list[tuple[list[str], dict, str]] = []
        for name, group in groups.items():
            group = dict(group)
            weights = group.get("weights")
            if not weights:
                continue
            form = group.get("format") or default_format
            if form not in FORMATS:
                raise ValueError(f"compressed-tensors format {form!r} (config group {name!r}) is not supported; "
                                 f"supported: {', '.join(FORMATS)}")
            self.groups.append((list(group.get("targets") or []), dict(weights), form))

    def quantized_module(self, tensor_name: str) -> str | None:
        for suffix in (".weight_scale", ".weight_packed"):
            if tensor_name.endswith(suffix):
                return tensor_name[:-len(suffix)]
        return None

    def module_tensors(self, module: str, names: set[str]) -> list[str]:
        return [f"{module}.{t}" for t in WEIGHT_TENSORS if f"{module}.{t}" in names]

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensors:
        args, form = self._scheme_of(module)
        if "weight_scale" not in tensors:
            raise ValueError(f"quantized checkpoint module {module!r} has no weight_scale")
        g_idx = tensors.get("weight_g_idx")
        if form == "pack-quantized":
            return self._packed(module, tensors, args, g_idx)
        weight = tensors.get("weight")
        if weight is None:
            raise ValueError(f"quantized checkpoint module {module!r} ({form}) has no weight")
        scale = _scale(module, tensors["weight_scale"], *weight.shape, args)
        if args.get("type") == "float":
            if weight.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{module!r}: a float-quantized weight must be float8_e4m3fn, not {weight.dtype}")
            return QuantizedTensors(weight.contiguous(), scale).check(module)
        if weight.dtype != torch.int8:
            raise ValueError(f"{module!r}: an int-quantized weight must be int8, not {weight.dtype}")
        zero = _zero(module, tensors, args)
        return to_canonical(weight.to(torch.int32) + 128, 8, scale, None if zero is None else zero + 128,
                            _act_order(g_idx, weight.shape[1], scale)).check(module)

    def _packed(self, module: str, tensors: dict[str, torch.Tensor], args: dict, g_idx: torch.Tensor | None
                ) -> QuantizedTensors:
        if "weight_shape" not in tensors or "weight_packed" not in tensors:
            raise ValueError(f"pack-quantized module {module!r} lacks weight_packed or weight_shape")
        rows, columns = (int(v) for v in tensors["weight_shape"].tolist())
        bits = int(args.get("num_bits", 0))
        unsigned = unpack_int32(tensors["weight_packed"], bits, columns, dim=1)
        if unsigned.shape[0] != rows:
            raise ValueError(f"{module!r}: weight_packed has {unsigned.shape[0]} rows, weight_shape says {rows}")
        scale = _scale(module, tensors["weight_scale"], rows, columns, args)
        zero = None
        if not args.get("symmetric", True):
            if "weight_zero_point" not in tensors:
                raise ValueError(f"asymmetric module {module!r} has no weight_zero_point")
            zero = unpack_int32(tensors["weight_zero_point"], bits, rows, dim=0)
        return to_canonical(unsigned, bits, scale, zero, _act_order(g_idx, columns, scale)).check(module)

    def _scheme_of(self, module: str) -> tuple[dict, str]:
        for targets, weights, form in self.groups:
            if any(_matches(module, target) for target in targets):
                return weights, form
        raise ValueError(f"quantized checkpoint module {module!r} matches no compressed-tensors config group")


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or module == target or module.endswith("." + target)


def _scale(module: str, scale: torch.Tensor, rows: int, columns: int, args: dict) -> torch.Tensor:
    """The checkpoint's scales → float32 [N] or [N, G], checked against the configured strategy."""
    strategy, scale = args.get("strategy"), scale.float()
    if strategy == "tensor" and scale.numel() == 1:
        return scale.reshape(1).expand(rows).contiguous()
    if strategy == "channel" and scale.numel() == rows:
        return scale.reshape(rows).contiguous()
    if strategy == "group":
        group_size = int(args.get("group_size") or 0)
        if group_size <= 0 or columns % group_size or scale.shape != (rows, columns // group_size):
            raise ValueError(f"{module!r}: group size {group_size} does not fit weight_scale {tuple(scale.shape)} of "
                             f"a weight [{rows}, {columns}] (groups must split the input features evenly)")
        return scale.contiguous()
    if strategy == "block":
        block_rows, block_columns = (int(v) for v in args.get("block_structure") or (0, 0))
        if block_rows <= 0 or columns % block_columns or scale.shape != (-(-rows // block_rows),
                                                                          columns // block_columns):
            raise ValueError(f"{module!r}: block {block_rows}x{block_columns} does not fit weight_scale "
                             f"{tuple(scale.shape)} of a weight [{rows}, {columns}]")
        return scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()
    raise ValueError(f"{module!r}: weight_scale {tuple(scale.shape)} does not fit strategy {strategy!r} for a "
                     f"weight [{rows}, {columns}]")


def _zero(module: str, tensors: dict[str, torch.Tensor], args: dict) -> torch.Tensor | None:
    if args.get("symmetric", True):
        return None
    if "weight_zero_point" not in tensors:
        raise ValueError(f"asymmetric module {module!r} has no weight_zero_point")
    return tensors["weight_zero_point"].float()


def _act_order(g_idx: torch.Tensor | None, columns: int, scale: torch.Tensor) -> torch.Tensor | None:
    if g_idx is None or scale.dim() == 1 or trivial_g_idx(g_idx, columns // scale.shape[1]):
        return None
    return g_idx
