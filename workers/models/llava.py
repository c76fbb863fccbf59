"""LLaVA-1.5: a CLIP ViT vision tower and a two-layer projector whose image features stand in for <image> tokens of
a llama-family language model."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from workers.distributed import Intermediate, parallel_state
from workers.layers.attention import StepMetadata
from workers.fast_path.fused_stage import FusedGreedyDecoding, FusedStage
from workers.models.llama import LlamaForCausalLM
from workers.models.mistral import MistralForCausalLM
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.prompt_embeds import StepEmbeds

_LANGUAGE_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}


def feature_layers(config: PretrainedConfig) -> list[int]:
    """The tower's hidden states the projector reads (0: the embeddings, i: after layer i), from
    vision_feature_layer (an index or a list of them, negative from the last)."""
    chosen = config.vision_feature_layer
    num_states = config.vision_config.num_hidden_layers + 1
    return [index % num_states for index in (chosen if isinstance(chosen, (list, tuple)) else [chosen])]


def image_feature_count(config: PretrainedConfig) -> int:
    """Features (placeholder tokens) per image: one per patch, plus the class token under the "full" strategy."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")


def image_token_id(config: PretrainedConfig) -> int:
    token = getattr(config, "image_token_id", None)
    return token if token is not None else config.image_token_index


class CLIPEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         config.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.position_embedding = nn.Embedding((config.image_size // config.patch_size) ** 2 + 1, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(len(pixel_values), 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = (proj(x).view(batch, length, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """The CLIP ViT up to the deepest hidden state the projector reads (the layers after it, and the post-norm,
    are never built: their checkpoint tensors are skipped)."""

    def __init__(self, config: PretrainedConfig, layers: list[int]) -> None:
        super().__init__()
        self.layers = layers
        self.embeddings = CLIPEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, max(layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, patches + 1, hidden × len(layers)]: the chosen hidden states side by side."""
        states = [self.pre_layrnorm(self.embeddings(pixel_values))]
        for layer in self.encoder.layers:
            states.append(layer(states[-1]))
        return torch.cat([states[i] for i in self.layers], dim=-1)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: PretrainedConfig, vision_width: int) -> None:
        super().__init__()
        bias, text_hidden = getattr(config, "multimodal_projector_bias", True), config.get_text_config().hidden_size
        self.linear_1 = nn.Linear(vision_width, text_hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(FusedGreedyDecoding, nn.Module):
    """The language model is the family's own causal LM (its fast path included); the tower and projector run once
    per image (encode_images) and their rows replace the placeholders' embeddings as given rows (StepEmbeds)."""

    num_intermediate_tensors = 2
    takes_prompt_embeds = True
    takes_images = True
    # Checkpoint name prefixes → ours, applied in order: transformers 5 writes `language_model.model.`,
    # `vision_tower.` and `multi_modal_projector.`; its in-memory names and llava-hf's hub folders differ.
    checkpoint_prefixes = {"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.",
                           "model.multi_modal_projector.": "multi_modal_projector.",
                           "lm_head.": "language_model.lm_head.", "vision_tower.vision_model.": "vision_tower."}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        text = config.get_text_config()
        if text.model_type not in _LANGUAGE_MODELS:
            raise ValueError(f"LLaVA with a {text.model_type!r} language model is not supported; "
                             f"supported: {sorted(_LANGUAGE_MODELS)}")
        self.language_model = _LANGUAGE_MODELS[text.model_type](text)
        self.packed_modules = self.language_model.packed_modules
        self.tie_word_embeddings = self.language_model.tie_word_embeddings
        self.weight_aliases = {f"language_model.{name}": f"language_model.{param}"
                               for name, param in self.language_model.weight_aliases.items()}
        self.vision_tower = self.multi_modal_projector = None
        if parallel_state().is_first_stage:
            layers, vision = feature_layers(config), config.vision_config
            self.vision_tower = CLIPVisionTower(vision, layers)
            self.multi_modal_projector = LlavaMultiModalProjector(config, vision.hidden_size * len(layers))
        self.keeps_class_token = config.vision_feature_select_strategy == "full"

    @staticmethod
    def image_inputs(config: PretrainedConfig) -> dict:
        """EngineInfo's image fields: the placeholder token and every image's feature count."""
        return {"image_token_id": image_token_id(config), "image_feature_count": image_feature_count(config)}

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, image_sizes: Sequence[None] = ()) -> torch.Tensor:
        """[images, channels, height, width] → [images, features, hidden]: the rows their placeholders take (the
        encoder cache's call gives image_sizes, which tiling families read: here every image is one whole view)."""
        features = self.vision_tower(pixel_values)
        return self.multi_modal_projector(features if self.keeps_class_token else features[:, 1:])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata,
                intermediate: Intermediate | None = None, prompt_embeds: StepEmbeds | None = None
                ) -> torch.Tensor | Intermediate:
        return self.language_model(input_ids, positions, metadata, intermediate, prompt_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    fused_compute_logits = compute_logits

    def fused_parts(self) -> tuple[FusedStage, nn.Module | None, nn.Module | None] | None:
        return self.language_model.fused_parts()
