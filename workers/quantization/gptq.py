"""GPTQ checkpoints (AutoGPTQ / GPTQModel): 4- or 8-bit weights packed along the input dimension into int32
(`qweight` [K / pack, N]), zero points packed along the output dimension (`qzeros` [G, N / pack], stored minus one
in the original `gptq` layout, as is in `gptq_v2`), `scales` [G, N], and with act-order (`desc_act`) a `g_idx`
giving each input column its group. GPTQModel's `dynamic` overrides bits and group size per module."""
from __future__ import annotations

import re
from typing import Any

import torch

from workers.quantization.formats import (QuantizedTensors, check_bits, config_value, to_canonical, trivial_g_idx,
                                          unpack_int32)

WEIGHT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


class GPTQFormat:
    name = "gptq"

    def __init__(self, config: Any) -> None:
        self.bits = check_bits(int(config_value(config, "bits", 0)), (4, 8), "GPTQ")
        self.group_size = int(config_value(config, "group_size", -1))
        self.desc_act = bool(config_value(config, "desc_act", False))
        layout = config_value(config, "checkpoint_format") or config_value(config, "format") or "gptq"
        if layout not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {layout!r} is not supported (gptq or gptq_v2)")
        self.zero_offset = 1 if layout == "gptq" else 0
        self.dynamic = dict(config_value(config, "dynamic") or {})
        for key, override in self.dynamic.items():
            if not key.startswith("-:"):
                check_bits(int(override.get("bits", self.bits)), (4, 8), f"GPTQ dynamic {key!r}")

    def quantized_module(self, tensor_name: str) -> str | None:
        return tensor_name[:-len(".qweight")] if tensor_name.endswith(".qweight") else None

    def module_tensors(self, module: str, names: set[str]) -> list[str]:
        return [f"{module}.{t}" for t in WEIGHT_TENSORS if f"{module}.{t}" in names]

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensors:
        override = self._dynamic_of(module)
        return convert_gptq(module, tensors, int(override.get("bits", self.bits)),
                            int(override.get("group_size", self.group_size)), self.zero_offset,
                            bool(override.get("desc_act", self.desc_act)))

    def _dynamic_of(self, module: str) -> dict:
        """GPTQModel's rule: the first `dynamic` pattern that matches the module's name ('+:' or no prefix
        overrides, '-:' leaves the module unquantized)."""
        for key, override in self.dynamic.items():
            pattern = key[2:] if key.startswith(("+:", "-:")) else key
            if re.match(pattern, module):
                if key.startswith("-:"):
                    raise ValueError(f"GPTQ module {module!r} is stored quantized, but dynamic {key!r} leaves it "
                                     "unquantized")
                return dict(override)
        return {}


def convert_gptq(module: str, tensors: dict[str, torch.Tensor], bits: int, group_size: int, zero_offset: int,
                 desc_act: bool = False) -> QuantizedTensors:
    """One module's GPTQ-packed tensors → canonical storage (`zero_offset`: 1 where zero points are stored minus
    one); ValueError when they do not fit the scheme."""
    for needed in ("qweight", "qzeros", "scales"):
        if needed not in tensors:
            raise ValueError(f"GPTQ module {module!r} has no {needed}")
    qweight, scales = tensors["qweight"], tensors["scales"]
    columns, rows = qweight.shape[0] * 32 // bits, qweight.shape[1]
    groups_of = columns if group_size == -1 else group_size
    if columns % groups_of or scales.shape != (columns // groups_of, rows):
        raise ValueError(f"GPTQ module {module!r}: group size {group_size} does not fit scales "
                         f"{tuple(scales.shape)} of a weight [{rows}, {columns}]")
    unsigned = unpack_int32(qweight, bits, columns, dim=0).t()
    zero = unpack_int32(tensors["qzeros"], bits, rows, dim=1).t() + zero_offset
    g_idx = tensors.get("g_idx")
    if desc_act and g_idx is None:
        raise ValueError(f"GPTQ module {module!r}: desc_act is set but the checkpoint has no g_idx")
    if g_idx is not None:
        if g_idx.numel() != columns:
            raise ValueError(f"GPTQ module {module!r}: g_idx has {g_idx.numel()} entries for {columns} columns")
        g_idx = None if trivial_g_idx(g_idx, groups_of) else g_idx
    return to_canonical(unsigned, bits, scales.t(), zero, g_idx).check(module)
