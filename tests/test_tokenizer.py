"""Where text meets the tokenizer (frontend/tokenizer.py, frontend/prompts.py): text that is not valid Unicode, and
conversations no template can take, are refused with a ValueError naming the field."""
from __future__ import annotations

import re

import pytest

from frontend.prompts import bad_words_token_ids, prompt_cache_salt, tokenize_prompt
from frontend.tokenizer import apply_chat_template, encode, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(llama_model):
    return load_tokenizer(llama_model)


@pytest.mark.parametrize("refuse, field", [
    (lambda tokenizer: tokenize_prompt(tokenizer, "a\ud800b"), "prompt"),
    (lambda tokenizer: tokenize_prompt(tokenizer, {"prompt": "\udfff"}), "prompt"),
    (lambda tokenizer: bad_words_token_ids(tokenizer, ["fine", "a\ud800"]), "bad_words"),
    (lambda tokenizer: prompt_cache_salt({"prompt": "hi", "cache_salt": "\ud800"}), "cache_salt"),
    (lambda tokenizer: apply_chat_template(tokenizer, [{"role": "user", "content": "fine"},
                                                       {"role": "user", "content": "a\ud800"}], "m"),
     "messages.1.content"),
])
def test_lone_surrogates_are_refused_naming_the_field(tokenizer, refuse, field):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)} contains a lone UTF-16 surrogate"):
        refuse(tokenizer)


def test_valid_text_encodes_as_the_tokenizer_does(tokenizer):
    text = "héllo wörld 🙂 \U0010ffff"
    assert encode(tokenizer, text, "prompt") == tokenizer.encode(text)


def test_an_empty_conversation_is_refused(tokenizer):
    with pytest.raises(ValueError, match="messages is empty"):
        apply_chat_template(tokenizer, [], "m")
