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
    """Greedy continuation of one prompt (batch of one: no padding to perturb the numerics), EOS ignored unless
    generate_args name one."""
    model = _hf_model(model_dir)
    input_ids = torch.tensor([prompt_token_ids])
    generate_args = {"min_new_tokens": 0, "eos_token_id": None, **generate_args}
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            do_sample=False, pad_token_id=0, **generate_args)
    return output[0, len(prompt_token_ids):].tolist()


@torch.inference_mode()
def hf_beam_search(model_dir: str, prompt_token_ids: list[int], max_new_tokens: int, num_beams: int,
                   eos_token_id: int | None, **generate_args) -> list[tuple[list[int], float]]:
    """All num_beams hypotheses of one prompt, best first: (generated token ids, length-penalized score)."""
    model = _hf_model(model_dir)
    input_ids = torch.tensor([prompt_token_ids])
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            min_new_tokens=0, num_beams=num_beams, num_return_sequences=num_beams, do_sample=False,
                            eos_token_id=eos_token_id, pad_token_id=0, return_dict_in_generate=True,
                            output_scores=True, **generate_args)
    # beam_indices is -1 past each hypothesis' end: the number of others is its generated length.
    lengths = (output.beam_indices != -1).sum(dim=1).tolist()
    generated = output.sequences[:, len(prompt_token_ids):]
    return [(generated[i, :n].tolist(), float(output.sequences_scores[i])) for i, n in enumerate(lengths)]


@torch.inference_mode()
def hf_logprobs(model_dir: str, token_ids: list[int], start: int) -> torch.Tensor:
    """Log-probabilities [len(token_ids) - start, vocab] of the tokens after position start - 1: what the engine
    reports for a completion of token_ids[start:] after the prompt token_ids[:start]."""
    logits = _hf_model(model_dir)(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)[start - 1:-1]
