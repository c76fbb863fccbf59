"""Load a model folder's tokenizer, encode text with it and apply its chat template (or one given instead)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_JINJA_CHARS = "{}\n"
# Folders whose tokenizer_config.json names one of these hold a plain tokenizer.json tokenizer: loaded without
# AutoTokenizer, whose import loads torch (transformers' rope utilities), so a front end attached to an engine stays
# free of torch. Any other class (a model's own rules for BOS, spaces, ...) goes through AutoTokenizer.
_PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def tokenizer_folder(model: str, tokenizer: str | None) -> str:
    """Where the tokenizer (and generation_config.json) come from: `tokenizer` when given, else the model folder.
    A GGUF file is loaded as weights only: its tokenizer comes from an HF folder (vLLM's advice too)."""
    if tokenizer:
        return tokenizer
    if model.endswith(".gguf") and Path(model).is_file():
        raise ValueError(f"model {model!r} is a GGUF file: give tokenizer= (--tokenizer), an HF folder with its "
                         "tokenizer files")
    return model


def model_folder(model: str, tokenizer_files: str | None) -> str:
    """The folder of the model's own files (generation_config.json): the model's, or for a GGUF file its tokenizer
    folder."""
    return model if Path(model).is_dir() or not tokenizer_files else tokenizer_files


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    try:
        if _tokenizer_class(model) in _PLAIN_TOKENIZER_CLASSES:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model {model!r}: cannot load its tokenizer: {exc}") from exc
    if not tokenizer.is_fast:
        raise ValueError(f"model {model!r}: a fast tokenizer (tokenizer.json) is required")
    return tokenizer


def _tokenizer_class(model: str) -> str | None:
    try:
        config = json.loads((Path(model) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def check_text(text: str, field: str) -> str:
    """`text` if it is valid Unicode; ValueError naming `field` if not. JSON lets a client send a lone UTF-16
    surrogate ("\\ud800"), which Python keeps in a str but no tokenizer, UTF-8 encoder or socket accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{field} contains a lone UTF-16 surrogate ({text[error.start]!r} at character "
                         f"{error.start}); send valid Unicode text") from None
    return text


# A normalizer may drop characters (accents, control characters), so a text's tokens may cover more of it than
# the longest vocabulary entry's length suggests: the bound keeps this much margin.
_NORMALIZER_MARGIN = 4


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """The most characters a prompt text can have and still fit in `max_model_len` tokens (no token covers more
    than the longest vocabulary entry): a longer one is refused without tokenizing it, which takes seconds for
    megabytes of text."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_model_len * max(longest, 1) * _NORMALIZER_MARGIN


def encode(tokenizer: PreTrainedTokenizerBase, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`, a client's `field` (named in the ValueError if the text is not valid Unicode)."""
    return tokenizer.encode(check_text(text, field), add_special_tokens=add_special_tokens)


def load_chat_template(value: str) -> str:
    """vLLM's rule for `--chat-template`: the file's text if `value` names a file, else `value` itself as the
    template (backslash escapes such as \\n decoded); a value that looks like a path (none of "{", "}", newline)
    but cannot be read, or a template Jinja cannot parse, is a ValueError."""
    try:
        with open(value, encoding="utf-8") as file:
            template = file.read()
    except (OSError, ValueError) as error:  # ValueError: not UTF-8, or a NUL in the name
        if not any(char in value for char in _JINJA_CHARS):
            raise ValueError(f"chat template {value!r} looks like a file path but cannot be read: {error}") from None
        template = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template {value[:80]!r} is not valid Jinja: {error} (line {error.lineno})") from None
    return template


# apply_chat_template's own arguments: a template variable may not take their place.
_RESERVED_TEMPLATE_VARIABLES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(template_kwargs: dict[str, Any] | None) -> None:
    """ValueError if a template variable would take the place of one of apply_chat_template's own arguments."""
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES.intersection(template_kwargs or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: they have their own fields")


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict], model: str,
                        add_generation_prompt: bool = True, chat_template: str | None = None,
                        tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """The conversation as prompt text through `chat_template` (a template's text; default: the tokenizer's); the
    template's own special tokens are already in it. `template_kwargs`: extra variables the template reads (vLLM's
    chat_template_kwargs, e.g. enable_thinking)."""
    check_template_kwargs(template_kwargs)
    chat_template = chat_template or getattr(tokenizer, "chat_template", None)
    if not chat_template:
        raise ValueError(f"model {model!r} has no chat template in its tokenizer_config.json; give one (the "
                         "server's --chat-template FILE, LLM.chat(chat_template=...)) or send a plain prompt "
                         "instead (LLM.generate, /v1/completions)")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    for index, message in enumerate(messages):
        for key, value in message.items():
            if isinstance(value, str):
                check_text(value, f"messages.{index}.{key}")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, tools=tools,
                                             **(template_kwargs or {}))
    # raise_exception() in the template, or a template that breaks on this input (a value of a type it did not
    # expect, in a message or in template_kwargs): the request's fault, not the server's
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as error:
        raise ValueError(f"the chat template failed on these messages: {type(error).__name__}: {error}") from None
