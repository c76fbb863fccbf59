"""One INFO line per finished HTTP request: id, token counts, finish reasons, latency; its text only if asked."""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

logger = logging.getLogger("pagedserve.api.requests")


class RequestLogger:
    """`--disable-log-requests` means no RequestLogger at all; `--log-prompts` adds the prompt and output text (at
    most `max_log_len` characters or token ids each, `--max-log-len`), which may hold personal data."""

    def __init__(self, log_prompts: bool = False, max_log_len: int | None = None) -> None:
        self.log_prompts, self.max_log_len = log_prompts, max_log_len

    def log_request(self, request_id: str, num_prompt_tokens: int, num_completion_tokens: int,
                    finish_reasons: Sequence[str | None], seconds: float, prompt: str | list | None = None,
                    output: str | list | None = None) -> None:
        """Log a request once it has ended (finish reasons: one per choice, e.g. "stop", "length", "abort")."""
        if not logger.isEnabledFor(logging.INFO):
            return
        line = (f"request {request_id}: {num_prompt_tokens} prompt + {num_completion_tokens} completion tokens, "
                f"finish {_summary(finish_reasons)}, {seconds:.3f} s")
        if self.log_prompts:
            line += f", prompt: {self._clip(prompt)!r}, output: {self._clip(output)!r}"
        logger.info(line)

    def _clip(self, text: str | list | None) -> str | list | None:
        if text is None or self.max_log_len is None or len(text) <= self.max_log_len:
            return text
        return text[:self.max_log_len] + ("..." if isinstance(text, str) else ["..."])


def _summary(finish_reasons: Sequence[str | None]) -> str:
    """"stop" for one choice, "length x3, stop" for four: a request with many choices stays one short line."""
    counts = Counter(str(reason) for reason in finish_reasons)
    return ", ".join(reason if count == 1 else f"{reason} x{count}" for reason, count in counts.items()) or "none"
