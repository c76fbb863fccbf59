"""The prompt forms a front end accepts (text, {"prompt": text}, {"prompt_token_ids": [...]}, {"prompt_embeds": tensor},
{"prompt": text, "multi_modal_data": {"image": images}}) and their token ids."""
from __future__ import annotations

import msgspec
from transformers import PreTrainedTokenizerBase

from frontend.multimodal import ImageProcessor, check_image_prompt, images_of
from frontend.tokenizer import check_text, encode
from ipc import EngineCoreRequest, EngineInfo, LoRARequest, PromptEmbeds, SamplingParams

PromptType = str | dict


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: PromptType) -> list[int]:
    """The prompt's token ids; ValueError for a prompt of the wrong shape or an empty one."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        return ids
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        raise ValueError(f"prompt must be a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                         f"got {type(prompt).__name__}")
    if not text:
        raise ValueError("prompt is empty")
    return encode(tokenizer, text, "prompt")


def prompt_embeds_of(prompt: PromptType) -> PromptEmbeds | None:
    """A dict prompt's "prompt_embeds" (a [seq_len, hidden_size] floating tensor, vLLM's form) as the engine takes
    it, or None; its token ids are then placeholders (ValueError for a tensor of another shape or dtype)."""
    if not isinstance(prompt, dict) or prompt.get("prompt_embeds") is None:
        return None
    embeds = prompt["prompt_embeds"]
    return embeds if isinstance(embeds, PromptEmbeds) else PromptEmbeds.of(embeds)


def prompt_text(prompt: PromptType) -> str | None:
    return prompt if isinstance(prompt, str) else prompt.get("prompt")


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """A dict prompt's optional "cache_salt": requests with different salts never share cached KV blocks."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return None
    if not (isinstance(salt, str) and salt):
        raise ValueError("cache_salt must be a non-empty string")
    return check_text(salt, "cache_salt")


def engine_request(tokenizer: PreTrainedTokenizerBase, info: EngineInfo, request_id: str, prompt: PromptType,
                   params: SamplingParams, priority: int = 0, lora_request: LoRARequest | None = None,
                   image_processor: ImageProcessor | None = None) -> EngineCoreRequest:
    """The validated engine-core request for one prompt (ValueError naming what is wrong); a prompt's images run
    through the model's image processor here."""
    check_sampling_params(params)
    if params.bad_words and params.bad_words_token_ids is None:
        params = msgspec.structs.replace(params, bad_words_token_ids=bad_words_token_ids(tokenizer, params.bad_words))
    images = images_of(prompt)
    if images is not None:
        check_image_prompt(prompt, image_processor)
    embeds = prompt_embeds_of(prompt)
    token_ids = tokenize_prompt(tokenizer, prompt) if embeds is None else [0] * embeds.num_rows
    mm_inputs = None
    if images is not None:
        token_ids, mm_inputs = image_processor.expand(token_ids, images)
    request = EngineCoreRequest(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                                eos_token_id=tokenizer.eos_token_id, priority=int(priority),
                                cache_salt=prompt_cache_salt(prompt), lora_request=lora_request, prompt_embeds=embeds,
                                mm_inputs=mm_inputs)
    info.validate_request(request)
    return request


def check_sampling_params(params: object) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    return params


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, bad_words: list[str]) -> list[list[int]]:
    """Each bad word as it tokenizes alone and after a space (mid-sentence), without duplicates."""
    sequences: list[list[int]] = []
    for word in bad_words:
        for text in (word, " " + word):
            ids = encode(tokenizer, text, "bad_words", add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
