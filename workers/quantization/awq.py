"""AWQ checkpoints (AutoAWQ's GEMM layout): 4-bit weights packed along the output dimension into int32 (`qweight`
[K, N / 8]) in the interleaved order 0 2 4 6 1 3 5 7, zero points packed alike (`qzeros` [G, N / 8]), `scales`
[G, N]; real weight = (q - zero) * scale."""
from __future__ import annotations

from typing import Any

import torch

from workers.quantization.formats import QuantizedTensors, check_bits, config_value, to_canonical, unpack_int32

WEIGHT_TENSORS = ("qweight", "qzeros", "scales")
# Nibble i of a packed int32 holds column PACK_ORDER[i] of its 8; this reads them back in column order.
PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
UNPACK_ORDER = tuple(PACK_ORDER.index(column) for column in range(8))


class AWQFormat:
    name = "awq"

    def __init__(self, config: Any) -> None:
        check_bits(int(config_value(config, "bits", config_value(config, "w_bit", 0))), (4,), "AWQ")
        version = str(config_value(config, "version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (gemm)")
        if not config_value(config, "zero_point", True):
            raise ValueError("AWQ without zero points is not supported")
        self.group_size = int(config_value(config, "group_size", config_value(config, "q_group_size", 128)))

    def quantized_module(self, tensor_name: str) -> str | None:
        return tensor_name[:-len(".qweight")] if tensor_name.endswith(".qweight") else None

    def module_tensors(self, module: str, names: set[str]) -> list[str]:
        return [f"{module}.{t}" for t in WEIGHT_TENSORS if f"{module}.{t}" in names]

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensors:
        return convert_awq(module, tensors, self.group_size)


def convert_awq(module: str, tensors: dict[str, torch.Tensor], group_size: int) -> QuantizedTensors:
    """One module's AWQ GEMM tensors (4-bit) → canonical storage; ValueError when they do not fit `group_size`."""
    for needed in WEIGHT_TENSORS:
        if needed not in tensors:
            raise ValueError(f"AWQ module {module!r} has no {needed}")
    qweight, scales = tensors["qweight"], tensors["scales"]
    columns, rows = qweight.shape[0], qweight.shape[1] * 8
    groups_of = columns if group_size == -1 else group_size
    if columns % groups_of or scales.shape != (columns // groups_of, rows):
        raise ValueError(f"AWQ module {module!r}: group size {group_size} does not fit scales "
                         f"{tuple(scales.shape)} of a weight [{rows}, {columns}]")
    unsigned = _in_column_order(unpack_int32(qweight, 4, rows, dim=1)).t()
    zero = _in_column_order(unpack_int32(tensors["qzeros"], 4, rows, dim=1)).t()
    return to_canonical(unsigned, 4, scales.t(), zero).check(module)


def _in_column_order(values: torch.Tensor) -> torch.Tensor:
    return values.reshape(values.shape[0], -1, 8)[..., list(UNPACK_ORDER)].reshape(values.shape[0], -1)
