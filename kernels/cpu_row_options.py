"""What a multi-step C++ call (kernels.cpu_greedy_decode) applies to its rows' logits before each token: the
sampler's draws, its logit processing (bias, penalties) and grammars' masks."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SampledRows:
    """Rows greedy_decode() samples instead of taking the argmax: those with temperature > 0 (float32 [rows]; 0: the
    argmax), by kernels/csrc/sample.h's rules (Sampler's: top_k <= 0, top_p 1 and min_p 0 are none), reading each
    row's uniform draws (float64 [rows, kernels.cpu_greedy_decode.draw_columns]) in the order the sampler's steps
    would draw them (kernels/csrc/greedy_decode.h's RowSampling)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    draws: np.ndarray


@dataclass(frozen=True)
class PenalizedRows:
    """Each row's logits processed as the sampler processes them (workers/layers/sampler.py) before its argmax or
    draw, in greedy_decode()'s steps: its logit bias ({token: bias}), then presence and frequency penalties over its
    generated tokens (those before the call in `output`, then the call's) and the repetition penalty over every token
    it has seen (its `prompt` and generated ones); 0, 0, 1 and no bias: none. Then its `bad_words` (token lists)
    banned: the last token of each whose other tokens end the row's prompt and generated tokens."""

    presence: Sequence[float]
    frequency: Sequence[float]
    repetition: Sequence[float]
    bias: Sequence[dict[int, float]]
    output: Sequence[Sequence[int]]
    prompt: Sequence[Sequence[int]]
    bad_words: Sequence[Sequence[Sequence[int]]]

    def arrays(self, rows: int) -> tuple[np.ndarray, ...]:
        """As the kernel takes them (module.cpp's greedy_decode: penalized)."""
        fields = (self.presence, self.frequency, self.repetition, self.bias, self.output, self.prompt, self.bad_words)
        if any(len(field) != rows for field in fields):
            raise ValueError("penalized rows need a presence, frequency and repetition penalty, a bias, generated "
                             "tokens, a prompt and bad words per row")
        if any(not word for words in self.bad_words for word in words):
            raise ValueError("a bad word needs a token at least")
        bias_ids, bias_starts = flat_lists([list(bias) for bias in self.bias])
        bias_values = np.array([value for bias in self.bias for value in bias.values()], dtype=np.float32)
        words, word_starts = flat_lists([word for words in self.bad_words for word in words])
        word_rows = np.concatenate(([0], np.cumsum([len(words) for words in self.bad_words], dtype=np.int64)))
        return (*(np.ascontiguousarray(a, dtype=np.float32) for a in (self.presence, self.frequency, self.repetition)),
                bias_ids, bias_starts, bias_values, *flat_lists(self.output), *flat_lists(self.prompt), words,
                word_starts, word_rows)


@dataclass(frozen=True)
class GrammarMasks:
    """Rows whose tokens a grammar restricts in greedy_decode()'s steps (no drafts then): before each step the call
    runs before_step(tokens) (tokens: the run's so far, as GreedyRun.tokens), which fills the masks (int32 [rows,
    words]: bit j of word w allows token 32 * w + j) of the `constrained` rows (uint8 [rows]) and sets `halted`
    (uint8 [rows]) for rows that take no more steps; a row's scores are masked before its bias, penalties and draw."""

    bits: np.ndarray
    constrained: np.ndarray
    halted: np.ndarray
    before_step: Callable[[np.ndarray], None]

    def arrays(self, rows: int) -> tuple[np.ndarray, ...]:
        """As the kernel takes them (module.cpp's greedy_decode: masks)."""
        for name, dtype, shape in (("bits", np.int32, None), ("constrained", np.uint8, (rows,)),
                                   ("halted", np.uint8, (rows,))):
            array = getattr(self, name)
            if not (array.dtype == dtype and array.flags.c_contiguous and array.ndim == (2 if shape is None else 1)
                    and array.shape[0] == rows and (shape is None or array.shape == shape)):
                raise ValueError(f"grammar masks' {name} must be a contiguous {np.dtype(dtype).name} array with a "
                                 f"row per row")
        return self.bits, self.constrained, self.halted


def flat_lists(lists: Sequence[Collection[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ints as one int64 array and each one's start in it (with the end after the last)."""
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64)
    return flat, np.concatenate(([0], np.cumsum([len(row) for row in lists], dtype=np.int64)))


