"""HuggingFace transformers greedy generation, the reference our float32 outputs must equal."""
from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM
from transformers import logging as hf_logging


@functools.cache
def _hf_model(model_dir: str):
    hf_logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt_token_ids: list[int], max_new_tokens: int, **generate_args) -> list[int]:
    """Greedy continuation of one prompt (batch of one: no padding to perturb the numerics), EOS ignored."""
    model = _hf_model(model_dir)
    input_ids = torch.tensor([prompt_token_ids])
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0, **generate_args)
    return output[0, len(prompt_token_ids):].tolist()
