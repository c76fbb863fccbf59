"""GPTQ checkpoints (AutoGPTQ / GPTQModel): 4- or 8-bit weights packed along the input dimension into int32
(`qweight` [K / pack, N]), zero points packed along the output dimension (`qzeros` [G, N / pack], stored minus one
in the original `gptq` layout, as is in `gptq_v2`), `scales` [G, N], and with act-order (`desc_act`) a `g_idx`
giving each input column its group."""
from __future__ import annotations

from typing import Any

import torch

from workers.quantization.formats import QuantizedTensors, config_value, to_canonical, trivial_g_idx, unpack_int32

WEIGHT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


class GPTQFormat:
    name = "gptq"

    def __init__(self, config: Any) -> None:
        self.bits = int(config_value(config, "bits", 0))
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQ with {self.bits} bits is not supported (4 or 8)")
        self.group_size = int(config_value(config, "group_size", -1))
        self.desc_act = bool(config_value(config, "desc_act", False))
        layout = config_value(config, "checkpoint_format") or config_value(config, "format") or "gptq"
        if layout not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {layout!r} is not supported (gptq or gptq_v2)")
        self.zero_offset = 1 if layout == "gptq" else 0

    def quantized_module(self, tensor_name: str) -> str | None:
        return tensor_name[:-len(".qweight")] if tensor_name.endswith(".qweight") else None

    def module_tensors(self, module: str, names: set[str]) -> list[str]:
        return [f"{module}.{t}" for t in WEIGHT_TENSORS if f"{module}.{t}" in names]

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensors:
        for needed in ("qweight", "qzeros", "scales"):
            if needed not in tensors:
                raise ValueError(f"GPTQ module {module!r} has no {needed}")
        qweight, scales = tensors["qweight"], tensors["scales"]
        columns, rows = qweight.shape[0] * 32 // self.bits, qweight.shape[1]
        group_size = columns if self.group_size == -1 else self.group_size
        if columns % group_size or scales.shape != (columns // group_size, rows):
            raise ValueError(f"GPTQ module {module!r}: group size {self.group_size} does not fit scales "
                             f"{tuple(scales.shape)} of a weight [{rows}, {columns}]")
        unsigned = unpack_int32(qweight, self.bits, columns, dim=0).t()
        zero = unpack_int32(tensors["qzeros"], self.bits, rows, dim=1).t() + self.zero_offset
        g_idx = tensors.get("g_idx")
        if self.desc_act and g_idx is None:
            raise ValueError(f"GPTQ module {module!r}: desc_act is set but the checkpoint has no g_idx")
        if g_idx is not None:
            if g_idx.numel() != columns:
                raise ValueError(f"GPTQ module {module!r}: g_idx has {g_idx.numel()} entries for {columns} columns")
            g_idx = None if trivial_g_idx(g_idx, group_size) else g_idx
        return to_canonical(unsigned, self.bits, scales.t(), zero, g_idx).check(module)
