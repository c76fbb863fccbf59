"""FP8 block-quantized checkpoints (DeepSeek-V3's; transformers' FineGrainedFP8): float8_e4m3fn weights [N, K] with a
float32 `weight_scale_inv` per block of weight_block_size [bn, bk], [ceil(N / bn), ceil(K / bk)] of them; real
weight = q * the scale of its block. Kept in fp8, each row with its blocks' scales as groups along K: read as fp8 by
the C++ products (kernels/cpu_gemv.py, the fused decoder layer) where bk divides K; a last block narrower than bk makes
unequal groups (each column names its group), multiplied a tile at a time dequantized in torch."""
from __future__ import annotations

from typing import Any

import torch

from workers.quantization.formats import QuantizedTensors, config_value

WEIGHT_TENSORS = ("weight", "weight_scale_inv")


class FP8BlockFormat:
    name = "fp8"

    def __init__(self, config: Any) -> None:
        fmt = config_value(config, "fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint format {fmt!r} is not supported (e4m3)")
        block = config_value(config, "weight_block_size", None)
        if not block or len(block) != 2 or min(block) < 1:
            raise ValueError("fp8 checkpoints are read with weight_block_size [rows, columns] (block scales); this one "
                             f"has {block!r} (per-tensor or per-channel fp8 checkpoints are not supported)")
        scheme = config_value(config, "activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (dynamic: the activations stay in "
                             "the model dtype)")
        self.block_rows, self.block_columns = int(block[0]), int(block[1])

    def quantized_module(self, tensor_name: str) -> str | None:
        return tensor_name[:-len(".weight_scale_inv")] if tensor_name.endswith(".weight_scale_inv") else None

    def module_tensors(self, module: str, names: set[str]) -> list[str]:
        return [f"{module}.{t}" for t in WEIGHT_TENSORS if f"{module}.{t}" in names]

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensors:
        if "weight" not in tensors:
            raise ValueError(f"fp8 module {module!r} has a weight_scale_inv but no weight")
        weight, scale = tensors["weight"], tensors["weight_scale_inv"].float()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"fp8 module {module!r}: the weight is {weight.dtype} {tuple(weight.shape)}, not a 2-D "
                             "float8_e4m3fn")
        rows, columns = weight.shape
        blocks = (-(-rows // self.block_rows), -(-columns // self.block_columns))
        if tuple(scale.shape) != blocks:
            raise ValueError(f"fp8 module {module!r}: weight_scale_inv {tuple(scale.shape)} does not give one scale "
                             f"per {self.block_rows}x{self.block_columns} block of a weight {tuple(weight.shape)}")
        row_scales = scale.repeat_interleave(self.block_rows, dim=0)[:rows].contiguous()
        g_idx = None if columns % self.block_columns == 0 else \
            (torch.arange(columns) // self.block_columns).to(torch.int32)
        return QuantizedTensors(weight.contiguous(), row_scales, None, g_idx).check(module)
