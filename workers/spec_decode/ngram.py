"""Prompt-lookup drafts: what followed the latest earlier occurrence of the longest suffix of a request's tokens."""
from __future__ import annotations

import numpy as np


def ngram_draft(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to num_tokens tokens that followed the latest earlier occurrence of the longest suffix of `tokens` (at
    least min_n, at most max_n long); none if no suffix of min_n tokens occurred before."""
    # Every earlier position holding the last token ends a candidate match; extend all of them backwards at once.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, len(tokens) - 1)):
        earlier = ends - back
        alive &= earlier >= 0
        alive[alive] = tokens[earlier[alive]] == tokens[-1 - back]
        if not alive.any():
            break
        matched += alive
    if not len(ends) or matched.max() < min_n:
        return []
    end = ends[matched == matched.max()][-1]
    return tokens[end + 1:end + 1 + num_tokens].tolist()
