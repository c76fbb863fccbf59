"""A multi-step call's grammars (workers/fast_path/step_grammars.py): the forks take each row's tokens in order and fill its
mask before each step; a rejected token halts its row; a row the call stopped takes no more of its grammar's work."""
from __future__ import annotations

import numpy as np

from workers.fast_path.step_grammars import CallGrammars


class _Grammar:
    """Allows tokens below `limit`; the mask's word w is filled with the number of tokens taken so far."""

    def __init__(self, limit: int, log: list) -> None:
        self.limit, self.log, self.taken = limit, log, []

    def accept(self, token_id: int) -> bool:
        self.taken.append(token_id)
        return token_id < self.limit

    @property
    def is_terminated(self) -> bool:
        return False

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self.log.append(("fill", row, list(self.taken)))
        bitmask[row] = len(self.taken)

    def fork(self) -> _Grammar:
        fork = _Grammar(self.limit, self.log)
        fork.taken = list(self.taken)
        return fork


def test_each_step_feeds_fills_halts_and_leaves_a_stopped_row_alone():
    log: list = []
    grammars = {"a": _Grammar(100, log), "b": _Grammar(100, log), "c": _Grammar(5, log)}
    calls = CallGrammars(grammars, ["a", "plain", "b", "c"], [[1], [], [2, 3], []], words_per_row=2)
    masks = calls.masks([0, 1, 2, 3])
    assert masks.constrained.tolist() == [1, 0, 1, 1]
    out = np.full((4, 3), -1, dtype=np.int64)

    masks.before_step(out)  # before the first step: each fork past its request's earlier tokens
    assert log == [("fill", 0, [1]), ("fill", 2, [2, 3]), ("fill", 3, [])]
    assert masks.bits[:, 0].tolist() == [1, 0, 2, 0] and masks.halted.tolist() == [0, 0, 0, 0]

    out[:, 0] = [7, 8, 9, 6]  # c's grammar rejects 6: the row halts
    log.clear()
    masks.before_step(out)
    assert log == [("fill", 0, [1, 7]), ("fill", 2, [2, 3, 9])]
    assert masks.halted.tolist() == [0, 0, 0, 1]

    out[0, 1] = 4  # b took no token at the second step: the call stopped it (a stop token or its limit)
    log.clear()
    masks.before_step(out)
    assert log == [("fill", 0, [1, 7, 4])]
    assert masks.bits[:, 0].tolist() == [3, 0, 3, 0]
    out[0, 2] = 5
    log.clear()
    masks.before_step(out)
    assert log == [("fill", 0, [1, 7, 4, 5])]
    assert [g.taken for g in grammars.values()] == [[], [], []]  # the engine core's own matchers: as they were
