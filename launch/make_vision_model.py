"""The vision model makers: tiny random-weight LLaVA-1.5 and LLaVA-NeXT folders (CLIP tower, projector, tiny llama) as
HF saves them."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaNextConfig, LlavaNextForConditionalGeneration,
                          LlavaNextImageProcessorPil, LlavaNextProcessor, LlavaProcessor, PretrainedConfig,
                          PreTrainedTokenizerFast, ProcessorMixin)

from launch.make_model import MARKER_FILE, quiet_transformers, write_model_folder
from launch.make_tokenizer import train_tokenizer
from launch.model_shapes import ENDOFTEXT_ID, INIT_STD, SIZES, config_kwargs

VISION_MAKER_VERSION = 1
IMAGE_TOKEN = "<image>"
# An image side that is not a multiple of the patch (the convolution drops the rest): floor(33 / 6) = 5 patches a
# side, 25 features an image, neither a power of two nor a multiple of a block.
IMAGE_SIZE, PATCH_SIZE = 33, 6
# LLaVA-NeXT's grids (height, width) in tiles of IMAGE_SIZE: wide, tall and square images each pick another.
GRID_PINPOINTS = ((33, 66), (66, 33), (66, 66), (33, 99))
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


def make_llava_next(out_dir: str | Path, seed: int = 0, feature_layer: int = -2,
                    grid_pinpoints: tuple[tuple[int, int], ...] = GRID_PINPOINTS) -> Path:
    """Write a random-weight LLaVA-NeXT folder at `out_dir` (anyres tiles of the tiny tower's size), or reuse the
    one already made from this spec."""
    spec = json.loads(json.dumps({"maker": "llava_next", "maker_version": VISION_MAKER_VERSION, "seed": seed,
                                  "feature_layer": feature_layer, "grid_pinpoints": grid_pinpoints}))
    return write_model_folder(out_dir, spec, _write_llava_next)


def _write_llava(folder: Path, spec: dict) -> None:
    tokenizer, text, vision = _parts()
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
    _save(folder, spec, LlavaForConditionalGeneration, config, processor)


def _write_llava_next(folder: Path, spec: dict) -> None:
    tokenizer, text, vision = _parts()
    config = LlavaNextConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                             image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                             vision_feature_layer=spec["feature_layer"], vision_feature_select_strategy="default",
                             projector_hidden_act="gelu", image_grid_pinpoints=spec["grid_pinpoints"],
                             image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2, tie_word_embeddings=False)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                                 image_grid_pinpoints=spec["grid_pinpoints"])
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                                   vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                                   num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    _save(folder, spec, LlavaNextForConditionalGeneration, config, processor)


def _parts() -> tuple[PreTrainedTokenizerFast, LlamaConfig, CLIPVisionConfig]:
    """The tokenizer with its <image> token, the tiny llama's config and the tiny CLIP tower's."""
    size = SIZES["tiny"]
    tokenizer = train_tokenizer(size.vocab)
    tokenizer.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tokenizer.model_max_length = size.max_positions
    tokenizer.chat_template = CHAT_TEMPLATE
    text = LlamaConfig(**config_kwargs("llama", size, len(tokenizer)))
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32,
                              initializer_range=INIT_STD, initializer_factor=1.0)
    return tokenizer, text, vision


def _save(folder: Path, spec: dict, model_class: type, config: PretrainedConfig, processor: ProcessorMixin) -> None:
    """The model drawn from the spec's seed, saved with its processor, image processor and tokenizer."""
    with quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = model_class(config).to(torch.float32)
        _widen_vision_weights(model)
        model.generation_config = GenerationConfig(bos_token_id=ENDOFTEXT_ID, eos_token_id=ENDOFTEXT_ID,
                                                   pad_token_id=ENDOFTEXT_ID)
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        processor.image_processor.save_pretrained(folder)  # preprocessor_config.json, which older readers look for
        processor.tokenizer.save_pretrained(folder, save_jinja_files=False)
    (folder / MARKER_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def _widen_vision_weights(model: torch.nn.Module) -> None:
    """The tower's and projector's matrices drawn as wide as the language model's: at HF's default scale the image
    features are too faint beside the token embeddings for two images to change a greedy continuation."""
    for name, param in model.named_parameters():
        if ("vision_tower" in name or "multi_modal_projector" in name) and param.dim() >= 2:
            param.normal_(0.0, INIT_STD * 2)
