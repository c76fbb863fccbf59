"""Read a model folder's HF config and derive what the engine needs from it (dtype, max length)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from workers.quantization.gguf import is_gguf, load_gguf_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(model: str) -> PretrainedConfig:
    """The folder's config.json (or a GGUF file's metadata); a clear ValueError when it is neither."""
    if is_gguf(model):
        return load_gguf_config(model)
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


def resolve_dtype(dtype: str) -> torch.dtype:
    """'auto' → bfloat16: half the memory of float32 for weights and KV cache. On CPUs without bf16
    instructions its matmuls run as float32 GEMMs (see kernels.matmul_dtype), so it stays fast there too."""
    return torch.bfloat16 if dtype == "auto" else _DTYPES[dtype]



def num_experts_of(config: PretrainedConfig) -> int:
    """Routed experts per MoE layer; 0 for a dense model."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def check_parallel_sizes(config: PretrainedConfig, tp_size: int, pp_size: int, expert_parallel: bool = False
                         ) -> None:
    """Refuse a tp × pp split the model cannot take, before any worker starts (ValueError naming it)."""
    if expert_parallel and not num_experts_of(config):
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model; this one has no experts")
    if tp_size * pp_size == 1:
        return
    if config.num_attention_heads % tp_size:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} is not divisible by "
                         f"tensor_parallel_size={tp_size}")
    if config.num_hidden_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {config.num_hidden_layers} layers")
