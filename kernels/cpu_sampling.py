"""Sampling by temperature alone on CPU in one C++ pass per row (kernels/csrc/sample.h).

torch's way, a softmax then a float64 cumsum over the whole vocabulary and a search, took 0.65 ms for 64 rows of
8,256 on a 2-core AVX-512 EPYC, most of a sampled decode step's work outside the model; the kernel computes the
weights and per-block sums in one pass and sums token by token only inside the block that holds the point. Same
rule and float64 sums as Sampler._inverse_cdf over softmax(logits / t), so the same token but where rounding puts
the point within a few ulps of a token's boundary.
"""
from __future__ import annotations

import torch

from kernels import cpu_extension


def serves(logits: torch.Tensor) -> bool:
    """Whether sample() takes these logits: float32 rows on the CPU, kernels built."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and cpu_extension.ready() is not None)


def sample(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A token per row of logits [rows, vocab] (float32), drawn from softmax(logits / temperature[row]) by the inverse
    CDF at uniform[row] in [0, 1) (float64): the first token whose running sum of weights passes uniform x their
    sum. Raises ValueError for a row where no token has weight (every logit -inf, or a NaN)."""
    module = cpu_extension.load()
    if module is None:
        raise RuntimeError("the C++ CPU kernels could not be built")
    rows, vocab = logits.shape
    logits = logits.contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    uniform = uniform.to(torch.float64).reshape(rows).contiguous()
    if temperature.shape != (rows,) or not bool((temperature > 0).all()):
        raise ValueError("sample() needs one temperature > 0 per row")
    tokens = torch.empty(rows, dtype=torch.int64)
    module.sample(logits.data_ptr(), rows, vocab, temperature.data_ptr(), uniform.data_ptr(), tokens.data_ptr())
    if bool((tokens < 0).any()):
        bad = (tokens < 0).nonzero().flatten().tolist()
        raise ValueError(f"rows {bad} have no token to sample: every logit is -inf, or one is NaN")
    return tokens
