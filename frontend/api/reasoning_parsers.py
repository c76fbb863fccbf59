"""Reasoning parsers (--reasoning-parser): a chat answer's <think>...</think> section as reasoning_content and the
rest as content, whole or as stream deltas, and where that section lies for the engine's output constraint."""
from __future__ import annotations

from dataclasses import dataclass

from frontend.api.tool_parsers import held_back
from ipc import ReasoningSection

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """deepseek_r1: the answer begins inside the section (its template opens <think> in the prompt). qwen3: only an
    answer that begins with <think> has one (a non-thinking Qwen3 writes plain content). Either way a prompt that
    ends with </think> (thinking switched off by the template) means no section, and one that ends with <think>
    means the answer begins inside it."""

    optional: bool


REASONING_PARSERS = {"deepseek_r1": ReasoningParser(optional=False), "qwen3": ReasoningParser(optional=True)}


def section_start(parser: ReasoningParser, prompt: str) -> str:
    """"inside" (the answer begins in the section), "maybe" (only if it begins with <think>) or "closed" (none)."""
    tail = prompt.rstrip()
    if tail.endswith(THINK_CLOSE):
        return "closed"
    return "inside" if tail.endswith(THINK_OPEN) or not parser.optional else "maybe"


def reasoning_section(start: str, tokenizer) -> ReasoningSection | None:
    """The section as the engine's constraint gate reads it (token ids of the markers); None when closed."""
    if start == "closed":
        return None
    end = tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
    opener = tokenizer.encode(THINK_OPEN, add_special_tokens=False)
    # A multi-token <think> cannot be allowed as one first token: the section then opens only in the prompt.
    open_token_id = opener[0] if start == "maybe" and len(opener) == 1 else None
    if start == "maybe" and open_token_id is None:
        return None
    return ReasoningSection(end_token_ids=end, open_token_id=open_token_id)


class ReasoningSplitter:
    """One answer's text, fed as it streams, split into (reasoning, content) deltas. A marker split across deltas
    is held back until it is whole; finish() releases what is held. A leading <think> is dropped; after a section,
    content starts past </think> and the whitespace that follows it."""

    def __init__(self, start: str) -> None:
        # "opening": a <think> may still begin the answer; then "inside" (or "content" when start was "maybe").
        self.state = "content" if start == "closed" else "opening"
        self.after_opening = "inside" if start == "inside" else "content"
        self.has_section = start == "inside"
        self.buffer = ""
        self.content_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.state == "opening":
            if self.buffer.startswith(THINK_OPEN):
                self.buffer, self.state, self.has_section = self.buffer[len(THINK_OPEN):], "inside", True
            elif not THINK_OPEN.startswith(self.buffer):
                self.state = self.after_opening
            else:
                return "", ""  # could still become <think>
        if self.state == "inside":
            end = self.buffer.find(THINK_CLOSE)
            if end < 0:
                keep = held_back(self.buffer, THINK_CLOSE)
                reasoning, self.buffer = self.buffer[:keep], self.buffer[keep:]
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:end], self.buffer[end + len(THINK_CLOSE):], "content"
        content, self.buffer = self._content(self.buffer), ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the answer has ended."""
        held, self.buffer = self.buffer, ""
        if self.state == "opening":
            self.state = self.after_opening
        if self.state == "inside":
            return held, ""
        return "", self._content(held)

    def _content(self, text: str) -> str:
        if self.has_section and not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        return text


def split_reasoning(start: str, text: str) -> tuple[str | None, str | None]:
    """A whole answer as (reasoning_content, content): None for a part it does not have."""
    splitter = ReasoningSplitter(start)
    reasoning, content = splitter.feed(text)
    rest_reasoning, rest_content = splitter.finish()
    reasoning, content = reasoning + rest_reasoning, content + rest_content
    if not splitter.has_section:
        return None, text
    return reasoning, content or None
