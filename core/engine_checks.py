"""The engine core's start-up checks of its config against the model: the runner, an encoder's limits, the maximum
length, a draft model's fit, the KV cache's capacity (each a ValueError naming what does not fit)."""
from __future__ import annotations

import msgspec

from ipc import EngineConfig
from workers.model_config import load_hf_config, model_max_len


def resolve_runner(runner: str, generates: bool) -> str:
    if runner == "auto":
        return "generate" if generates else "pooling"
    if runner == "generate" and not generates:
        raise ValueError("runner 'generate' needs a decoder with a language-model head; this model embeds, scores "
                         "and classifies: use runner 'pooling'")
    return runner


def check_encoder_config(config: EngineConfig) -> None:
    """What an encoder-only model's engine cannot do (ValueError naming it)."""
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ValueError("encoder-only models run on one rank: tensor_parallel_size and pipeline_parallel_size "
                         "must be 1")
    if config.enable_lora or config.speculative_config is not None or config.quantization is not None:
        raise ValueError("encoder-only models take no LoRA adapters, speculative decoding or quantization")


def resolve_max_model_len(config: EngineConfig, model_limit: int) -> EngineConfig:
    if config.max_model_len is None:
        return msgspec.structs.replace(config, max_model_len=model_limit)
    if config.max_model_len > model_limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's maximum length "
                         f"{model_limit} (max_position_embeddings)")
    return config


def check_draft_model(config: EngineConfig, vocab_size: int) -> None:
    """A draft model must share the target's vocabulary and reach max_model_len (ValueError saying which not)."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return
    try:
        draft = load_hf_config(spec.model)
    except (OSError, ValueError) as error:
        raise ValueError(f"speculative_config.model {spec.model!r} is not a model folder: {error}") from None
    if draft.vocab_size != vocab_size:
        raise ValueError(f"speculative_config.model has a vocabulary of {draft.vocab_size} tokens, the target "
                         f"{vocab_size}: a draft model must use the target's tokenizer")
    if model_max_len(draft) < config.max_model_len:
        raise ValueError(f"speculative_config.model reaches {model_max_len(draft)} positions, fewer than "
                         f"max_model_len={config.max_model_len}; lower max_model_len")


def check_capacity(config: EngineConfig, num_blocks: int) -> None:
    capacity = num_blocks * config.block_size
    if capacity < config.max_model_len:
        raise ValueError(f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.block_size}), fewer "
                         f"than max_model_len={config.max_model_len}; raise gpu_memory_utilization/kv_cache_memory/"
                         "num_kv_blocks or lower max_model_len")
