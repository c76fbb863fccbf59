"""The grammars of a multi-step call's constrained requests: a fork of each one's matcher, lent by the engine core
that runs in this process, advanced by the call's tokens; it fills each later step's token mask. The engine core's
own matchers advance as ever, by the tokens the call returns."""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from ipc import GrammarBitmask
from kernels.cpu_row_options import GrammarMasks

logger = logging.getLogger("pagedserve.step_grammars")


class StepGrammar(Protocol):
    """A request's matcher as the engine core holds it (core/structured_output/backends.RequestGrammar)."""

    def accept(self, token_id: int) -> bool: ...

    @property
    def is_terminated(self) -> bool: ...

    def fill(self, bitmask: np.ndarray, row: int) -> None: ...

    def fork(self) -> StepGrammar: ...


LentGrammars = Mapping[str, StepGrammar]  # by request id: the matchers the engine core lends a multi-step call


class CallGrammars:
    """Forks of the constrained requests' matchers, by their index in the call's requests, each past the tokens the
    call gave it so far. A request whose fork rejects a token, ends its grammar or fails to fill its mask takes no
    more steps in the call: the engine core's matcher meets the same token and acts on it."""

    def __init__(self, grammars: LentGrammars, req_ids: Sequence[str], tokens: Sequence[list[int]],
                 words_per_row: int) -> None:
        self.words_per_row = words_per_row
        self.forks: dict[int, StepGrammar] = {}
        self.ended: set[int] = set()
        self.req_ids = req_ids
        for i, req_id in enumerate(req_ids):
            if (grammar := grammars.get(req_id)) is not None:
                try:
                    self.forks[i] = grammar.fork()
                except Exception:  # the engine core's own matcher goes on; this request takes no later steps
                    logger.exception("forking the grammar of request %s failed", req_id)
                    self.ended.add(i)
                    continue
                self.take(i, tokens[i])

    def __bool__(self) -> bool:
        """Whether any request of the call is constrained."""
        return bool(self.forks) or bool(self.ended)

    def take(self, i: int, tokens: list[int]) -> None:
        """Advance request i's fork (if it has one) by the tokens it took."""
        if i in self.forks and i not in self.ended:
            self._follow(i, lambda fork: fork if all(map(fork.accept, tokens)) and not fork.is_terminated else None)

    def _follow(self, i: int, step: Callable[[StepGrammar], StepGrammar | None]) -> None:
        """Request i's fork becomes step(fork); None or an exception ends its steps (the engine core's matcher meets
        the same end)."""
        try:
            fork = step(self.forks[i])
        except Exception:
            logger.exception("the grammar of request %s failed in a multi-step call", self.req_ids[i])
            fork = None
        if fork is None:
            self.ended.add(i)
        else:
            self.forks[i] = fork

    def bitmask(self, rows: Sequence[int], req_ids: Sequence[str]) -> GrammarBitmask | None:
        """The masks of the constrained ones among `rows` (req_ids: theirs), for the step's sampler."""
        constrained = [(i, req_id) for i, req_id in zip(rows, req_ids) if i in self.forks]
        if not constrained:
            return None
        packed = np.zeros((len(constrained), self.words_per_row), dtype=np.int32)
        for row, (i, req_id) in enumerate(constrained):
            if i not in self.ended:
                self._follow(i, lambda fork: fork.fill(packed, row) or fork)
            if i in self.ended:  # this step allows every token: the engine core's matcher fails at the same place
                packed[row] = -1
        return GrammarBitmask(req_ids=[req_id for _, req_id in constrained], words_per_row=self.words_per_row,
                              packed=packed.astype("<i4", copy=False).tobytes())

    def masks(self, rows: Sequence[int]) -> GrammarMasks:
        """The masks of a C++ call (kernels.cpu_greedy_decode.greedy_decode) of `rows`: before each step the forks
        take the tokens the call gave since the last, then fill their rows' masks or halt them."""
        bits = np.zeros((len(rows), self.words_per_row), dtype=np.int32)
        # Plain lists and ints, no array operations: the callback runs between steps, after each step's weights
        # have passed through the caches, where every array operation's dispatch is a round of cache misses.
        going = [m for m, i in enumerate(rows) if i in self.forks]
        constrained, halted = np.zeros(len(rows), dtype=np.uint8), np.zeros(len(rows), dtype=np.uint8)
        constrained[going] = 1
        fed = [0] * len(rows)
        stepped = False

        def before_step(tokens: np.ndarray) -> None:
            nonlocal stepped
            columns = tokens.shape[1]
            for m in tuple(going):
                i, new = rows[m], []
                while fed[m] < columns and (token := tokens.item(m, fed[m])) >= 0:
                    new.append(token)
                    fed[m] += 1
                if stepped and not new:  # the call stopped the row (a stop token, its limit): it takes no more steps
                    going.remove(m)
                    continue
                self.take(i, new)
                if i not in self.ended:
                    self._follow(i, lambda fork: fork.fill(bits, m) or fork)
                if i in self.ended:
                    halted[m] = 1
                    going.remove(m)
            stepped = True

        return GrammarMasks(bits, constrained, halted, before_step)
