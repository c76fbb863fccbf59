"""AutoRound checkpoints (`quant_method: auto-round`, written by Intel's auto-round package): integer weights in the
GPTQ or AWQ packing that `packing_format` names, with per-layer overrides of the scheme in `extra_config`."""
from __future__ import annotations

import re
from typing import Any

import torch

from workers.quantization.awq import convert_awq
from workers.quantization.formats import QuantizedTensors, check_bits, config_value
from workers.quantization.gptq import GPTQFormat, convert_gptq

# packing_format → (layout, zero-point offset): auto_gptq stores zero points minus one (auto-round's
# qlinear_torch_zp), its plain and gptqmodel packings store them as they are (qlinear_torch).
PACKINGS = {"auto_round:auto_gptq": ("gptq", 1), "auto_round": ("gptq", 0), "auto_round:gptqmodel": ("gptq", 0),
            "auto_round:auto_awq": ("awq", 0)}
# Older names auto-round's loader still reads as the packings above (and "auto_round:gptq" is transformers' default).
PACKING_ALIASES = {"auto": "auto_round:auto_gptq", "auto_round:gptq": "auto_round:auto_gptq",
                   "auto_round:awq": "auto_round:auto_awq"}
LAYOUT_BITS = {"gptq": (4, 8), "awq": (4,)}
SCHEME_KEYS = ("bits", "group_size", "sym", "data_type", "act_bits")
FULL_PRECISION_BITS = 16
REGEX_CHARACTERS = set("*+?^$[](){}|\\")


class AutoRoundFormat:
    name = "auto-round"
    # Both packings name a module's tensors as GPTQ does (AWQ's are GPTQ's without g_idx).
    quantized_module = GPTQFormat.quantized_module
    module_tensors = GPTQFormat.module_tensors

    def __init__(self, config: Any) -> None:
        packing = str(config_value(config, "packing_format") or "auto_round:auto_gptq")
        self.packing = PACKING_ALIASES.get(packing, packing)
        if self.packing not in PACKINGS:
            raise ValueError(f"AutoRound packing_format {self.packing!r} is not supported; supported: "
                             f"{', '.join(PACKINGS)}")
        self.layout, self.zero_offset = PACKINGS[self.packing]
        self.default = {key: config_value(config, key) for key in SCHEME_KEYS}
        extra = config_value(config, "extra_config") or {}
        self.extra: dict[str, dict] = {name: dict(override) for name, override in extra.items()}
        self._check(self.default, "AutoRound quantization_config")
        for name, override in self.extra.items():
            scheme = {**self.default, **override}
            if _quantized(scheme):
                self._check(scheme, f"AutoRound extra_config {name!r}")

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensors:
        scheme = self.scheme_of(module)
        if not _quantized(scheme):
            raise ValueError(f"AutoRound module {module!r} is stored quantized, but extra_config leaves it at "
                             f"{scheme['bits']} bits")
        group_size = int(scheme["group_size"] if scheme["group_size"] is not None else -1)
        if self.layout == "awq":
            return convert_awq(module, tensors, group_size)
        return convert_gptq(module, tensors, int(scheme["bits"]), group_size, self.zero_offset)

    def scheme_of(self, module: str) -> dict:
        """auto-round's rule: the module's own extra_config entry, else the first pattern found in its name."""
        override = self.extra.get(module)
        if override is None:
            override = next((o for key, o in self.extra.items() if _found(key, module)), {})
        return {**self.default, **override}

    def _check(self, scheme: dict, where: str) -> None:
        """ValueError naming the setting of `scheme` the kernels cannot run, and what they can."""
        data_type = str(scheme["data_type"] or "int")
        if data_type != "int":
            raise ValueError(f"{where}: data_type {data_type!r} is not supported (int)")
        act_bits = int(scheme["act_bits"] or FULL_PRECISION_BITS)
        if act_bits < FULL_PRECISION_BITS:
            raise ValueError(f"{where}: act_bits {act_bits} (quantized activations) is not supported (16: weights "
                             "only)")
        group_size = int(scheme["group_size"] if scheme["group_size"] is not None else -1)
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"{where}: group_size {group_size} is not supported (a positive size, or -1 per row)")
        check_bits(int(scheme["bits"] or 0), LAYOUT_BITS[self.layout], f"{where} ({self.packing})")


def _quantized(scheme: dict) -> bool:
    return int(scheme["bits"] or FULL_PRECISION_BITS) < FULL_PRECISION_BITS


def _found(key: str, module: str) -> bool:
    """Whether an extra_config key names part of the module: a regular expression when it has regex characters
    (auto-round writes its patterns so), else a plain name searched for as written."""
    pattern = key if REGEX_CHARACTERS & set(key) else re.escape(key)
    try:
        return re.search(pattern, module) is not None
    except re.error:
        return False
