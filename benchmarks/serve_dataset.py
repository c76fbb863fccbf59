"""The serving benchmark's requests: ShareGPT-format conversations or random prompts, sampled with a seed."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

MIN_TOKENS = 4  # shorter prompts or answers say little about a server (the usual ShareGPT readers' floor)
CHARS_PER_TOKEN = 4  # the estimate of a text's tokens when no tokenizer is given
FIRST_RANDOM_ID = 3  # the model maker's tokenizers keep ids 0-2 for special tokens


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class RequestSpec:
    """One request: its prompt (text, or token ids for the completions endpoint) and how many tokens it asks for.
    `prompt_len` is the prompt's token count when known here (None: the server's usage tells)."""
    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None


def load_tokenizer(folder: str | None) -> Tokenizer | None:
    if folder is None:
        return None
    from transformers import AutoTokenizer  # only with --tokenizer: the benchmark itself needs no model

    return AutoTokenizer.from_pretrained(folder)


def count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    """The text's tokens under `tokenizer`, else an estimate from its length."""
    if tokenizer is None:
        return max(1, round(len(text) / CHARS_PER_TOKEN))
    return len(tokenizer.encode(text, add_special_tokens=False))


def first_turns(conversation: dict[str, Any]) -> tuple[str, str] | None:
    """The first human turn and the first gpt turn after it, or None when the conversation has no such pair."""
    turns = conversation.get("conversations")
    if not isinstance(turns, list):
        return None
    prompt = next((i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("from") == "human"), None)
    if prompt is None:
        return None
    answer = next((t for t in turns[prompt + 1:] if isinstance(t, dict) and t.get("from") == "gpt"), None)
    if answer is None or not isinstance(turns[prompt].get("value"), str) or not isinstance(answer.get("value"), str):
        return None
    return turns[prompt]["value"], answer["value"]


def sharegpt_requests(path: Path, num_prompts: int, seed: int, tokenizer: Tokenizer | None = None,
                      max_total_len: int = 2048, output_len: int | None = None) -> list[RequestSpec]:
    """`num_prompts` requests from a ShareGPT-format JSON file: each conversation's first human turn is the prompt and
    its first gpt turn's token count the output length (or `output_len`). Pairs under MIN_TOKENS either side or
    over `max_total_len` together are skipped; the rest are shuffled with `seed` and taken in turn, from the start
    again when there are fewer than asked for."""
    conversations = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(conversations, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} objects")
    pairs = [pair for item in conversations if isinstance(item, dict) and (pair := first_turns(item))]
    random.Random(seed).shuffle(pairs)
    usable: list[RequestSpec] = []
    for prompt, answer in pairs:
        prompt_len = count_tokens(prompt, tokenizer)
        wanted = output_len or count_tokens(answer, tokenizer)
        if prompt_len >= MIN_TOKENS and wanted >= MIN_TOKENS and prompt_len + wanted <= max_total_len:
            usable.append(RequestSpec(prompt, wanted, prompt_len if tokenizer is not None else None))
        if len(usable) == num_prompts:
            break
    if not usable:
        raise ValueError(f"{path}: no conversation has a prompt and an answer of {MIN_TOKENS} to {max_total_len} "
                         "tokens together")
    return [usable[i % len(usable)] for i in range(num_prompts)]


def random_requests(num_prompts: int, input_len: int, output_len: int, seed: int, vocab: int,
                    tokenizer: Tokenizer | None = None) -> list[RequestSpec]:
    """Prompts of `input_len` random token ids from [FIRST_RANDOM_ID, vocab): as ids, or as their text when a
    tokenizer is given (for the chat endpoint; that text may encode to a few tokens more or fewer)."""
    rng = random.Random(seed)
    specs = []
    for _ in range(num_prompts):
        ids = [rng.randrange(FIRST_RANDOM_ID, vocab) for _ in range(input_len)]
        if tokenizer is None:
            specs.append(RequestSpec(ids, output_len, input_len))
        else:
            text = tokenizer.decode(ids)
            specs.append(RequestSpec(text, output_len, count_tokens(text, tokenizer)))
    return specs
