"""The model maker's shapes: sizes, and each family's config.json on top of a llama-shaped one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENDOFTEXT_ID = 0  # <|endoftext|>, the maker's bos, eos and pad token

# Far wider than HF's 0.02: with tied embeddings (qwen2, opt) a tiny random model at <= 0.1 tends to
# repeat one token greedily; 0.15 gives varied continuations for every arch and size.
INIT_STD = 0.15
ROPE_PARAMETERS = {"rope_theta": 10000.0, "rope_type": "default"}


@dataclass(frozen=True)
class SizeSpec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    vocab: int
    sliding_window: int


SIZES = {
    "tiny": SizeSpec(64, 2, 4, 2, 128, 1024, vocab=1024, sliding_window=64),
    "30m": SizeSpec(512, 8, 8, 4, 1408, 2048, vocab=8192, sliding_window=512),
    "100m": SizeSpec(768, 12, 12, 4, 2560, 2048, vocab=8192, sliding_window=512),  # 102M as a llama
    # Llama-3-8B's shapes but its vocabulary (the config's; the trained tokenizer knows its first 8192 ids):
    # for GPU benchmarks, made without weights and served with load_format="dummy".
    "8b": SizeSpec(4096, 32, 32, 8, 14336, 8192, vocab=8192, sliding_window=4096),
}
# What a size's config holds beyond the SizeSpec.
SIZE_OVERRIDES = {"8b": {"vocab_size": 128256, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}}


def config_kwargs(arch: str, size: SizeSpec, tokenizer_vocab: int) -> dict[str, Any]:
    common = {
        "vocab_size": -(-tokenizer_vocab // 64) * 64,
        "hidden_size": size.hidden,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "max_position_embeddings": size.max_positions,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": ENDOFTEXT_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "dtype": "float32",
    }
    if arch == "opt":
        return common | {
            "ffn_dim": size.intermediate,
            "word_embed_proj_dim": size.hidden,
            "do_layer_norm_before": True,
            "tie_word_embeddings": True,
            "init_std": INIT_STD,
        }
    decoder = common | {
        "num_key_value_heads": size.kv_heads,
        "intermediate_size": size.intermediate,
        "initializer_range": INIT_STD,
        "rope_parameters": dict(ROPE_PARAMETERS),
        "tie_word_embeddings": arch == "qwen2",
    }
    return decoder | family_kwargs(arch, size)


def family_kwargs(arch: str, size: SizeSpec) -> dict[str, Any]:
    """What each family adds to (or changes in) the llama-shaped config; experts are a quarter MLP wide."""
    head_dim = size.hidden // size.heads
    moe = {"num_experts_per_tok": 2, "moe_intermediate_size": size.intermediate // 4}
    return {
        "mistral": {"sliding_window": size.sliding_window},
        "qwen3": {"head_dim": head_dim},
        "gemma2": {"head_dim": head_dim, "sliding_window": size.sliding_window, "tie_word_embeddings": True},
        # Gemma 3 (HF's text model type): sliding layers but every second, each layer type with its rope base.
        "gemma3_text": {"head_dim": head_dim, "sliding_window": size.sliding_window, "tie_word_embeddings": True,
                        "sliding_window_pattern": 2, "rope_parameters": {
                            "sliding_attention": dict(ROPE_PARAMETERS),
                            "full_attention": ROPE_PARAMETERS | {"rope_theta": 1e6}}},
        "gpt_neox": {"rope_parameters": ROPE_PARAMETERS | {"partial_rotary_factor": 0.25}},
        "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
        "qwen2_moe": moe | {"num_experts": 4, "shared_expert_intermediate_size": size.intermediate // 2},
        "qwen3_moe": moe | {"num_experts": 8, "head_dim": head_dim, "norm_topk_prob": True},
        # MLA: a latent of half the hidden size, rope and no-rope halves of each head; 2 of 8 experts in 4 groups.
        "deepseek_v2": moe | {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
                              "kv_lora_rank": size.hidden // 2, "q_lora_rank": None, "qk_rope_head_dim": head_dim // 2,
                              "qk_nope_head_dim": head_dim // 2, "v_head_dim": head_dim,
                              "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                              "num_key_value_heads": size.heads},
        # DeepSeek-V3: V2's MLA, sigmoid scores chosen with a correction bias (drawn: HF starts it at zero) within
        # the best 2 of 4 groups, normalised and scaled.
        "deepseek_v3": moe | {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
                              "kv_lora_rank": size.hidden // 2, "q_lora_rank": size.hidden // 2,
                              "qk_rope_head_dim": head_dim // 2, "qk_nope_head_dim": head_dim // 2,
                              "v_head_dim": head_dim, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                              "routed_scaling_factor": 2.5, "num_key_value_heads": size.heads},
    }.get(arch, {})
