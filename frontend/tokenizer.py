"""Load a model folder's tokenizer, encode text with it and apply its chat template."""
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


def check_text(text: str, field: str) -> str:
    """`text` if it is valid Unicode; ValueError naming `field` if not. JSON lets a client send a lone UTF-16
    surrogate ("\\ud800"), which Python keeps in a str but no tokenizer, UTF-8 encoder or socket accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{field} contains a lone UTF-16 surrogate ({text[error.start]!r} at character "
                         f"{error.start}); send valid Unicode text") from None
    return text


def encode(tokenizer: PreTrainedTokenizerBase, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`, a client's `field` (named in the ValueError if the text is not valid Unicode)."""
    return tokenizer.encode(check_text(text, field), add_special_tokens=add_special_tokens)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict], model: str,
                        add_generation_prompt: bool = True) -> str:
    """The conversation as prompt text; the template's own special tokens are already in it."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model!r} has no chat template in its tokenizer_config.json; "
                         "send a plain prompt instead (LLM.generate, /v1/completions)")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    for index, message in enumerate(messages):
        for key, value in message.items():
            if isinstance(value, str):
                check_text(value, f"messages.{index}.{key}")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
