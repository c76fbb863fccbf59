"""Read a model folder's HF config and derive what the engine needs from it (dtype, max length, KV shape)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(model: str) -> PretrainedConfig:
    """The folder's config.json; a clear ValueError when the folder is not a model folder."""
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model!r} is not a model folder: no config.json there "
                         "(models are HF-format folders on disk; there is no hub here)")
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise ValueError(f"model {model!r}: cannot read config.json: {exc}") from exc


def model_max_len(config: PretrainedConfig) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("the model config names no maximum length (max_position_embeddings); pass max_model_len")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' → bfloat16 where matmuls run natively in it (CUDA; CPUs with AVX512-BF16 or AMX), else float32.

    A CPU without those instructions emulates bfloat16 matmuls about 5x slower than float32 ones.
    """
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def kv_cache_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the model's KV cache."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim
