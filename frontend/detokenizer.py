"""Incremental detokenization (multi-byte safe) and stop-string matching for one request."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from ipc import SamplingParams


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive; a partial UTF-8 character is held back until complete
    (and dropped if generation ends inside it, where decode() would show U+FFFD)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams,
                 prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer._tokenizer
        # Seeding the stream with the prompt's tail lets tokenizers that strip a leading space decode correctly. A
        # tail that ends inside a UTF-8 character is cut before it: seeded with it, DecodeStream returns that
        # tail's text as part of the first output.
        tail = prompt_token_ids[-4:]
        while tail and self.tokenizer.decode(tail, skip_special_tokens=params.skip_special_tokens).endswith("\ufffd"):
            tail = tail[:-1]
        self.stream = DecodeStream(ids=tail, skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        self.text = ""

    def add_token(self, token_id: int) -> str | None:
        """Append one token's text; return the stop string if the text now contains one (text is cut there)."""
        piece = self.stream.step(self.tokenizer, token_id)
        if not piece:
            return None
        self.text += piece
        return self._check_stop(len(piece)) if self.stop else None

    def output_text(self, finished: bool) -> str:
        """The text a stream may show now: while running, the tail that could still begin a stop string is
        held back, since it would be cut if the stop string completes."""
        if finished or not self.stop or self.include_stop:
            return self.text
        hold = max(len(stop) for stop in self.stop) - 1
        return self.text[:max(0, len(self.text) - hold)]

    def _check_stop(self, new_chars: int) -> str | None:
        """The earliest stop string that overlaps the new text; the text is cut at it."""
        found = []
        for stop in self.stop:
            index = self.text.find(stop, max(0, len(self.text) - new_chars - len(stop) + 1))
            if index != -1:
                found.append((index, stop))
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[:index + len(stop)] if self.include_stop else self.text[:index]
        return stop
