"""A request's matcher behind its reasoning section: tokens pass unconstrained until the section ends, then the
grammar constrains the rest; the section can neither start inside the constrained output nor be escaped."""
from __future__ import annotations

import copy

import numpy as np

from core.structured_output.backends import RequestGrammar
from ipc import ReasoningSection


class ReasoningGate:
    """A RequestGrammar: `inner` once the output's reasoning section (as `section` places it) has ended."""

    def __init__(self, inner: RequestGrammar, section: ReasoningSection) -> None:
        self.inner, self.end = inner, list(section.end_token_ids)
        self.open_token_id = section.open_token_id
        self.first = True  # no token accepted yet: an open_token_id may still open the section
        self.inside = section.open_token_id is None
        self.recent: list[int] = []  # the section's last len(end) tokens

    def accept(self, token_id: int) -> bool:
        first, self.first = self.first, False
        if first and token_id == self.open_token_id:
            self.inside = True
            return True
        if not self.inside:
            return self.inner.accept(token_id)
        self.recent = (self.recent + [token_id])[-len(self.end):]
        self.inside = self.recent != self.end
        return True

    @property
    def is_terminated(self) -> bool:
        return not self.inside and self.inner.is_terminated

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        if self.inside:
            bitmask[row] = -1  # every token
            return
        self.inner.fill(bitmask, row)
        if self.first and self.open_token_id is not None:
            word, bit = divmod(self.open_token_id, 32)
            bitmask[row, word] |= np.int32(np.uint32(1 << bit).view(np.int32))

    def fork(self) -> ReasoningGate:
        fork = copy.copy(self)
        fork.inner, fork.recent = self.inner.fork(), list(self.recent)
        return fork
