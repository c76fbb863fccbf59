"""The LLaVA tests' images and greedy generation by transformers' LLaVA, the reference the engine must equal."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

FEATURES = 25  # the tiny tower's 5 × 5 patches (launch/make_vision_model.py)


def picture(seed: int, height: int = 41, width: int = 52) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_greedy(reference, prompt_token_ids: list[int], images: list[Image.Image], max_tokens: int) -> list[int]:
    """transformers' greedy continuation; `reference` is (its LlavaForConditionalGeneration, its image processor)."""
    model, processor = reference
    ids = torch.tensor([prompt_token_ids])
    pixels = {"pixel_values": processor(images, return_tensors="pt")["pixel_values"]} if images else {}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, **pixels)
    return out[0, ids.shape[1]:].tolist()
