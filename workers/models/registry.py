"""Map an HF config's `architectures` entry to our model class."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from workers.models.llama import LlamaForCausalLM
from workers.models.mistral import MistralForCausalLM
from workers.models.opt import OPTForCausalLM
from workers.models.qwen2 import Qwen2ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"model architectures {config.architectures} are not supported; "
                     f"supported: {sorted(_MODELS)}")
