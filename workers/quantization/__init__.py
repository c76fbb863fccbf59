"""Weight quantization behind the linear layers: one module per method; `quantize_model` applies the chosen one."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from workers.quantization.int8 import quantize_int8_model

METHODS = ("int8",)


def check_method(method: str | None) -> None:
    """ValueError naming the supported methods when `method` is not one of them (None: no quantization)."""
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization {method!r} is not supported; supported: {', '.join(METHODS)}")


def check_checkpoint(config: PretrainedConfig) -> None:
    """A checkpoint stored quantized (config.json's quantization_config) cannot be loaded yet: say so at load
    instead of failing on tensor names or, worse, computing with packed integers as if they were weights."""
    quant_config = getattr(config, "quantization_config", None)
    if quant_config:
        method = quant_config.get("quant_method") if isinstance(quant_config, dict) else \
            getattr(quant_config, "quant_method", None)
        raise ValueError(f"the checkpoint is quantized (quant_method {method!r}); quantized checkpoints are not "
                         "supported yet: load the unquantized model, optionally with quantization='int8'")


def quantize_model(model: nn.Module, method: str | None, quantize_lm_head: bool = False) -> None:
    """Quantize the loaded model's weights in place (no-op for None)."""
    check_method(method)
    if method == "int8":
        quantize_int8_model(model, quantize_lm_head)
