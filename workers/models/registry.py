"""Map an HF config's `architectures` entry to our model class."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from workers.models.bert import BertForSequenceClassification, BertModel
from workers.models.deepseek_v2 import DeepseekV2ForCausalLM
from workers.models.deepseek_v3 import DeepseekV3ForCausalLM
from workers.models.gemma2 import Gemma2ForCausalLM
from workers.models.gemma3 import Gemma3ForCausalLM, Gemma3TextOfConditionalGeneration
from workers.models.gpt_neox import GPTNeoXForCausalLM
from workers.models.llama import LlamaForCausalLM
from workers.models.llava import LlavaForConditionalGeneration
from workers.models.llava_next import LlavaNextForConditionalGeneration
from workers.models.mistral import MistralForCausalLM
from workers.models.mixtral import MixtralForCausalLM
from workers.models.opt import OPTForCausalLM
from workers.models.phi3 import Phi3ForCausalLM
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.models.qwen2_moe import Qwen2MoeForCausalLM
from workers.models.qwen3 import Qwen3ForCausalLM
from workers.models.qwen3_moe import Qwen3MoeForCausalLM


def _base_model(causal_lm: type[nn.Module]) -> type[nn.Module]:
    """A checkpoint of the decoder alone, as embedding models are saved (E5-Mistral's MistralModel): the causal
    LM without its head; it pools, it cannot generate."""
    class BaseModel(causal_lm):
        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.lm_head, self.weight_aliases = None, {}

    BaseModel.__name__ = BaseModel.__qualname__ = causal_lm.__name__.replace("ForCausalLM", "Model")
    return BaseModel


_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3TextOfConditionalGeneration,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    **{base: _base_model(causal_lm) for base, causal_lm in (
        ("LlamaModel", LlamaForCausalLM), ("MistralModel", MistralForCausalLM), ("Qwen2Model", Qwen2ForCausalLM),
        ("Qwen3Model", Qwen3ForCausalLM))},
}


def check_prompt_embeds(config: PretrainedConfig) -> None:
    """ValueError naming the model's family unless its forward takes prompt embeddings (takes_prompt_embeds)."""
    model_class = get_model_class(config)
    if not getattr(model_class, "takes_prompt_embeds", False):
        families = sorted(name for name, cls in _MODELS.items() if getattr(cls, "takes_prompt_embeds", False))
        raise ValueError(f"enable_prompt_embeds: the {model_class.__name__} family does not take prompt embeddings; "
                         f"those that do: {', '.join(families)}")


def image_inputs(config: PretrainedConfig) -> dict:
    """A vision-language model's EngineInfo image fields (its placeholder token, its features per image or its
    tiling rule); none for any other model."""
    model_class = get_model_class(config)
    return model_class.image_inputs(config) if getattr(model_class, "takes_images", False) else {}


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"model architectures {config.architectures} are not supported; "
                     f"supported: {sorted(_MODELS)}")
