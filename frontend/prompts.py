"""The prompt forms a front end accepts (text, {"prompt": text}, {"prompt_token_ids": [...]}) and their token ids."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

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
    return tokenizer.encode(text)


def prompt_text(prompt: PromptType) -> str | None:
    return prompt if isinstance(prompt, str) else prompt.get("prompt")
