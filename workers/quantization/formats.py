"""Quantized checkpoint formats: which one config.json's `quantization_config` names, and the canonical tensors
(kernels.quantized_matmul's storage) each quantized module of the checkpoint converts to."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kernels.quantized_matmul import check_quantized, dequantize, pack_int4


@dataclass
class QuantizedTensors:
    """One checkpoint module's weight as the kernels store it: weight, scale [N] or [N, G], zero, g_idx."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None

    def check(self, module: str) -> QuantizedTensors:
        try:
            check_quantized(self.weight, self.scale, self.zero, self.g_idx)
        except ValueError as e:
            raise ValueError(f"quantized checkpoint module {module!r}: {e}") from None
        return self

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.weight, self.scale, self.zero, self.g_idx)


class CheckpointFormat(Protocol):
    """A checkpoint's quantization method: which tensors of a module are its quantized weight, and their
    conversion."""

    name: str

    def quantized_module(self, tensor_name: str) -> str | None:
        """The module a tensor name marks as quantized (its weight's scales, packed weight...), else None."""

    def module_tensors(self, module: str, names: set[str]) -> list[str]:
        """The checkpoint tensors that make up the quantized weight of `module` (not its bias)."""

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensors:
        """Those tensors (keyed by name relative to the module) → canonical storage; ValueError when they
        contradict the configuration."""


def unpack_int32(packed: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """Values of `bits` (4 or 8) packed little-end-first into int32 along `dim` → int32 values 0..2^bits - 1,
    `count` of them along `dim` (GPTQ, AWQ and compressed-tensors' 4/8-bit packing)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, not {packed.dtype}")
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit weights are not supported (4 or 8)")
    moved = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*moved.shape[:-1], -1)
    if values.shape[-1] < count:
        raise ValueError(f"packed tensor holds {values.shape[-1]} values along dim {dim}, {count} expected")
    return values[..., :count].movedim(-1, dim)


def to_canonical(unsigned: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor | None,
                 g_idx: torch.Tensor | None = None) -> QuantizedTensors:
    """Unsigned values [N, K] (0..2^bits - 1) with scale [N, G] and a zero point in the same unsigned units (None:
    the middle, 2^(bits-1)) → canonical: 4-bit packed two per byte, 8-bit as int8 shifted by 128."""
    scale = scale.float().contiguous()
    if scale.dim() == 2 and scale.shape[1] == 1:
        scale = scale[:, 0].contiguous()
    if zero is not None:
        if zero.numel() != scale.numel():
            raise ValueError(f"zero points {tuple(zero.shape)} do not match the scales {tuple(scale.shape)}")
        zero = zero.float().reshape(scale.shape) - (0.0 if bits == 4 else 128.0)
        if bool((zero == (8.0 if bits == 4 else 0.0)).all()):  # symmetric after all: the faster kernels serve
            zero = None
    weight = pack_int4(unsigned) if bits == 4 else (unsigned.to(torch.int32) - 128).to(torch.int8)
    return QuantizedTensors(weight.contiguous(), scale, zero, None if g_idx is None else g_idx.to(torch.int32))


def trivial_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether act-order's g_idx is the plain k // group_size (then the uniform groups serve, faster)."""
    return torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group_size)


def check_bits(bits: int, supported: tuple[int, ...], where: str) -> int:
    """`bits`, or a ValueError naming `where` and the widths the kernels take."""
    if bits not in supported:
        raise ValueError(f"{where}: {bits}-bit weights are not supported ({' or '.join(map(str, supported))})")
    return bits


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """A key of quantization_config, which transformers leaves a dict or turns into an object."""
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)
