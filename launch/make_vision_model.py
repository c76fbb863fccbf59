"""The vision model maker: a tiny random-weight LLaVA-1.5 folder (CLIP tower, projector, tiny llama) as HF saves it."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor)

from launch.make_model import (ENDOFTEXT_ID, INIT_STD, MARKER_FILE, SIZES, _config_kwargs, quiet_transformers,
                               train_tokenizer, write_model_folder)

VISION_MAKER_VERSION = 1
IMAGE_TOKEN = "<image>"
# An image side that is not a multiple of the patch (the convolution drops the rest): floor(33 / 6) = 5 patches a
# side, 25 features an image, neither a power of two nor a multiple of a block.
IMAGE_SIZE, PATCH_SIZE = 33, 6
# The chat template of the tiny llama, with image parts written as <image> before the text (LLaVA-1.5's way).
CHAT_TEMPLATE = (
    r"{%- for message in messages %}"
    r"{{- '<|im_start|>' + message['role'] + '\n' }}"
    r"{%- if message['content'] is string %}{{- message['content'] }}"
    r"{%- else %}{%- for part in message['content'] %}"
    r"{%- if part['type'] == 'image' %}{{- '<image>' }}"
    r"{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    r"{%- endfor %}{%- endif %}"
    r"{{- '<|im_end|>\n' }}"
    r"{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def make_llava(out_dir: str | Path, seed: int = 0, feature_layer: int = -2, select_strategy: str = "default") -> Path:
    """Write a random-weight LLaVA-1.5 folder at `out_dir`, or reuse the one already made from this spec."""
    spec = json.loads(json.dumps({"maker": "llava", "maker_version": VISION_MAKER_VERSION, "seed": seed,
                                  "feature_layer": feature_layer, "select_strategy": select_strategy}))
    return write_model_folder(out_dir, spec, _write_llava)


def _write_llava(folder: Path, spec: dict) -> None:
    size = SIZES["tiny"]
    tokenizer = train_tokenizer(size.vocab)
    tokenizer.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tokenizer.model_max_length = size.max_positions
    tokenizer.chat_template = CHAT_TEMPLATE
    text = LlamaConfig(**_config_kwargs("llama", size, len(tokenizer)))
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32,
                              initializer_range=INIT_STD, initializer_factor=1.0)
    config = LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=spec["feature_layer"],
                         vision_feature_select_strategy=spec["select_strategy"], projector_hidden_act="gelu",
                         image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2, tie_word_embeddings=False)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                               vision_feature_select_strategy=spec["select_strategy"], image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    with quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = LlavaForConditionalGeneration(config).to(torch.float32)
        _widen_vision_weights(model)
        model.generation_config = GenerationConfig(bos_token_id=ENDOFTEXT_ID, eos_token_id=ENDOFTEXT_ID,
                                                   pad_token_id=ENDOFTEXT_ID)
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        image_processor.save_pretrained(folder)  # preprocessor_config.json, which older readers look for
        tokenizer.save_pretrained(folder, save_jinja_files=False)
    (folder / MARKER_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def _widen_vision_weights(model: torch.nn.Module) -> None:
    """The tower's and projector's matrices drawn as wide as the language model's: at HF's default scale the image
    features are too faint beside the token embeddings for two images to change a greedy continuation."""
    for name, param in model.named_parameters():
        if ("vision_tower" in name or "multi_modal_projector" in name) and param.dim() >= 2:
            param.normal_(0.0, INIT_STD * 2)
