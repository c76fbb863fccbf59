"""Weight quantization behind the linear layers: an online method quantizes a plain checkpoint at load (`int8`,
`fp8`); checkpoint formats load weights stored quantized, named by config.json's quantization_config, or GGUF
files."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ipc.config import QUANTIZATION_METHODS
from workers.quantization.autoround import AutoRoundFormat
from workers.quantization.awq import AWQFormat
from workers.quantization.compressed_tensors import CompressedTensorsFormat
from workers.quantization.formats import CheckpointFormat, config_value
from workers.quantization.fp8_blocks import FP8BlockFormat
from workers.quantization.gguf import is_gguf
from workers.quantization.gptq import GPTQFormat
from workers.quantization.online import quantize_model_rows

ONLINE_METHODS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
CHECKPOINT_FORMATS: dict[str, type] = {"compressed-tensors": CompressedTensorsFormat, "gptq": GPTQFormat,
                                       "awq": AWQFormat, "auto-round": AutoRoundFormat, "fp8": FP8BlockFormat}
METHODS = QUANTIZATION_METHODS


def check_method(method: str | None) -> None:
    """ValueError naming the supported methods when `method` is not one of them (None: as the checkpoint is)."""
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization {method!r} is not supported; supported: {', '.join(METHODS)}")


def check_quantization(model: str, config: PretrainedConfig, method: str | None) -> None:
    """ValueError, before any rank loads, when `method` does not fit the checkpoint (see checkpoint_format)."""
    if is_gguf(model):
        if method not in (None, "gguf"):
            raise ValueError(f"a GGUF file is loaded as its tensors are stored; quantization {method!r} cannot apply")
        return
    if method == "gguf":
        raise ValueError(f"quantization 'gguf' needs a .gguf file as the model, not {model!r}")
    checkpoint_format(config, method)


def checkpoint_format(config: PretrainedConfig, method: str | None = None) -> CheckpointFormat | None:
    """The format of a checkpoint stored quantized (None for plain weights), checked against the `quantization`
    asked for: ValueError for an unknown quant_method, a contradictory request or a malformed configuration, so
    that nothing computes with packed integers as if they were weights."""
    check_method(method)
    quant_config: Any = getattr(config, "quantization_config", None)
    if not quant_config:
        if method in CHECKPOINT_FORMATS and method not in ONLINE_METHODS:
            raise ValueError(f"quantization {method!r} needs a checkpoint stored in that format; this one has no "
                             "quantization_config")
        return None
    stored = config_value(quant_config, "quant_method")
    if stored not in CHECKPOINT_FORMATS:
        raise ValueError(f"the checkpoint's quant_method {stored!r} is not supported; supported: "
                         f"{', '.join(CHECKPOINT_FORMATS)}")
    if method is not None and method != stored:
        raise ValueError(f"the checkpoint is already quantized ({stored}); quantization {method!r} cannot apply: "
                         f"leave quantization unset (or {stored!r})")
    return CHECKPOINT_FORMATS[stored](quant_config)


def quantize_model(model: nn.Module, config: PretrainedConfig, method: str | None, quantize_lm_head: bool = False
                   ) -> None:
    """Quantize the loaded model's weights in place for an online method (no-op otherwise, and for a checkpoint
    stored quantized: "fp8" of an fp8 checkpoint means as it is stored)."""
    if method in ONLINE_METHODS and not getattr(config, "quantization_config", None):
        quantize_model_rows(model, quantize_lm_head, ONLINE_METHODS[method])
