"""Gemma 3 (text): Gemma 2's layers with a (1 + w) RMSNorm over each query and key head, sliding and global layers
from `layer_types` with a rope base each, and no attention soft-capping."""
from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from workers.layers.norm import GemmaRMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from workers.models.llama import head_dim_of

LAYER_TYPES = ("sliding_attention", "full_attention")


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    @staticmethod
    def soft_cap_of(config: PretrainedConfig) -> float | None:
        """None: transformers' Gemma 3 reads attn_logit_softcapping into its config but never caps the scores."""
        return None

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(x)
        return self.q_norm(q), self.k_norm(k), v


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_class = Gemma3DecoderLayer

    def layer_rotary(self, config: PretrainedConfig) -> Callable[[int], RotaryEmbedding]:
        """Sliding layers rotate with the local base, global ones with the global base and its scaling: transformers
        keeps them per layer type in `rope_parameters` (an older config's rope_local_base_freq, rope_theta and
        rope_scaling read into it)."""
        layer_types = config.layer_types
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown or len(layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types must give each of the {config.num_hidden_layers} layers one of "
                             f"{LAYER_TYPES}; got {layer_types}")
        rotary = {kind: RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                        dict(config.rope_parameters[kind])) for kind in set(layer_types)}
        return lambda layer_idx: rotary[layer_types[layer_idx]]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (EmbeddingGemma's encoder) is not supported: Gemma 3 is "
                             "served as a causal LM")
        super().__init__(config)

    def build_model(self, config: PretrainedConfig) -> Gemma3Model:
        return Gemma3Model(config)


class Gemma3TextOfConditionalGeneration(Gemma3ForCausalLM):
    """A Gemma3ForConditionalGeneration folder served on text alone: its language model, whose weights it reads
    under either layout transformers saves (the vision tower and projector are left unread; images are refused)."""

    checkpoint_prefixes = {"language_model.model.": "model.", "model.language_model.": "model.",
                           "language_model.lm_head.": "lm_head."}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config.get_text_config())
