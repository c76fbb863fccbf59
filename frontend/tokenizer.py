"""Load a model folder's tokenizer and apply its chat template."""
from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model {model!r}: cannot load its tokenizer: {exc}") from exc
    if not tokenizer.is_fast:
        raise ValueError(f"model {model!r}: a fast tokenizer (tokenizer.json) is required")
    return tokenizer


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict], model: str,
                        add_generation_prompt: bool = True) -> str:
    """The conversation as prompt text; the template's own special tokens are already in it."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model!r} has no chat template in its tokenizer_config.json; "
                         "use generate() with a plain prompt instead")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
