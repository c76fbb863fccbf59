"""Sampling on CPU in one C++ pass per row (kernels/csrc/sample.h): temperature, top-k, top-p and min-p; and the
logprobs the sampler reports (kernels/csrc/logprobs.h).

torch's way took 0.47 ms for 64 rows of 8,256 by temperature alone (a softmax, a float64 cumsum over the whole
vocabulary, a search), 6.4 ms with top-k 40, 5.4 with min-p and 26 with top-p 0.9 (a sort of every row), on a 2-core
AVX-512 EPYC: as much as the model's own step. The kernel finds top-k's and top-p's boundaries by radix selection,
computes the weights and per-block sums in one pass and sums token by token only inside the block that holds the
point. Same rules and float64 sums as Sampler._distribution and _inverse_cdf, so the same token but where rounding
puts the point, or a top-p boundary, within a few ulps of the edge (tied weights at a top-p boundary: the first
in token order, where torch keeps any).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import cpu_extension


def serves(logits: torch.Tensor) -> bool:
    """Whether sample() takes these logits: float32 rows on the CPU, kernels built."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and cpu_extension.ready() is not None)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of each row of logits [rows, vocab] (float32, as serves() takes them) by the kernel the C++
    multi-step calls report logprobs with (kernels/csrc/logprobs.h): both paths give the same bits."""
    module = cpu_extension.required()
    logits = logits.contiguous()
    logprobs = torch.empty_like(logits)
    module.log_softmax(logits.data_ptr(), logprobs.data_ptr(), *logits.shape)
    return logprobs


def sample(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, top_k: torch.Tensor | None = None,
           top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None, drafts: torch.Tensor | None = None,
           accept: torch.Tensor | None = None, draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """A token per row of logits [rows, vocab] (float32) at uniform[row] in [0, 1) (float64): drawn from
    softmax(logits / temperature) after top-k (<= 0: none), top-p (1: none) and min-p (0: none), per row (None: none
    for any row). With drafts (int64 [rows], -1: none) a row verifies its draft as speculative sampling does
    (Sampler._verify_drafts' rule; the tokens follow the distribution p): drawn from draft_probs (q: [rows, vocab]
    float32), kept where accept[row] x q(draft) < p(draft), else drawn from max(0, p - q); without draft_probs (a
    one-hot guess) kept where accept[row] < p(draft), else drawn from p without it. Raises ValueError for a row
    where no token has weight (every logit -inf, or a NaN)."""
    logits, options, per_row = _rows(logits, temperature, uniform, top_k, top_p, min_p)
    if (drafts is None) != (accept is None):
        raise ValueError("drafts need their accept draws")
    if drafts is not None:
        drafts, accept = per_row(drafts, -1, torch.int64), per_row(accept, 0.0, torch.float64)
    if draft_probs is not None:
        if drafts is None or draft_probs.shape != logits.shape:
            raise ValueError("draft_probs need drafts, and a row of the vocabulary per row")
        draft_probs = draft_probs.to(torch.float32).contiguous()
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    cpu_extension.required().sample(logits.data_ptr(), *logits.shape, *(t.data_ptr() for t in options),
                                    0 if drafts is None else drafts.data_ptr(),
                                    0 if accept is None else accept.data_ptr(),
                                    0 if draft_probs is None else draft_probs.data_ptr(), tokens.data_ptr())
    if bool((tokens < 0).any()):
        bad = (tokens < 0).nonzero().flatten().tolist()
        raise ValueError(f"rows {bad} have no token to sample: every logit is -inf, or one is NaN")
    return tokens


def draft(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, top_k: torch.Tensor | None = None,
          top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As sample() without drafts, also giving the distribution each row's token was drawn from (q [rows, vocab]
    float32: a draft model's, which verification takes); -1 for a row where no token has weight."""
    logits, options, _ = _rows(logits, temperature, uniform, top_k, top_p, min_p)
    tokens, q = torch.empty(logits.shape[0], dtype=torch.int64), torch.empty_like(logits)
    cpu_extension.required().draft(logits.data_ptr(), *logits.shape, *(t.data_ptr() for t in options), q.data_ptr(),
                                   tokens.data_ptr())
    return tokens, q


def _rows(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, top_k: torch.Tensor | None,
          top_p: torch.Tensor | None, min_p: torch.Tensor | None
          ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], Callable]:
    """The logits contiguous, the kernel's per-row options (temperature, top_k, top_p, min_p, uniform, each
    contiguous of its dtype) and the per_row() that made them; raises ValueError for a row's missing option or a
    temperature <= 0."""
    rows = logits.shape[0]

    def per_row(values: torch.Tensor | None, neutral: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((rows,), neutral, dtype=dtype) if values is None else values.to(dtype).reshape(-1)
        if out.shape != (rows,):
            raise ValueError("sampling needs one value per row")
        return out.contiguous()

    temperature, uniform = per_row(temperature, 1.0, torch.float32), per_row(uniform, 0.0, torch.float64)
    top_k, top_p, min_p = per_row(top_k, 0, torch.int64), per_row(top_p, 1.0, torch.float32), \
        per_row(min_p, 0.0, torch.float32)
    if not bool((temperature > 0).all()):
        raise ValueError("sampling needs temperatures > 0")
    return logits.contiguous(), (temperature, top_k, top_p, min_p, uniform), per_row
