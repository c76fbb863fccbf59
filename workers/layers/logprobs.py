"""The logprobs a request reports: of the model's own distribution (vLLM's default), the token's, its rank and the
best N, ties to the lower id; on the CPU by the kernel the C++ multi-step steps use (kernels/csrc/logprobs.h)."""
from __future__ import annotations

import torch

from kernels import cpu_sampling


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The rows' logprobs; on the CPU by the kernel a multi-step call's C++ steps report theirs with, so a token's
    logprobs have the same bits whichever step computed them."""
    return cpu_sampling.log_softmax(logits) if cpu_sampling.serves(logits) else torch.log_softmax(logits, dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
                    ) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """logprobs: [rows, vocab]; per row: [token, top-k ...] ids and logprobs, and the token's rank (1 = best)."""
    k = min(k, logprobs.shape[-1])  # a vocabulary smaller than the top-k asked for
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    ids, values = token_ids.unsqueeze(1), chosen
    if k:
        top_values, top_ids = _top_k(logprobs, k)
        ids, values = torch.cat((ids, top_ids), dim=1), torch.cat((values, top_values), dim=1)
    return ids.tolist(), values.tolist(), ranks.tolist()


def _top_k(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logprobs and their ids in order, ties to the lower id: torch.topk leaves the order of
    ties open, and bf16 logits tie often (the C++ steps' kernels/csrc/logprobs.h takes the same ones)."""
    values, ids = logprobs.topk(k, dim=-1)
    boundary = values[:, -1:]
    tied = ((logprobs >= boundary).sum(dim=1) > k) | (values[:, 1:] == values[:, :-1]).any(dim=1)
    for row in tied.nonzero().flatten().tolist():
        candidates = (logprobs[row] >= boundary[row]).nonzero().flatten()  # in id order
        ids[row] = candidates[torch.sort(logprobs[row, candidates], descending=True, stable=True).indices[:k]]
        values[row] = logprobs[row, ids[row]]
    return values, ids


def top_logprobs(logprobs: torch.Tensor, token: torch.Tensor, n: int) -> tuple[list[int], list[float], int]:
    """token: [1], on the logits' device."""
    ids, values, ranks = gather_logprobs(logprobs.unsqueeze(0), token, n)
    return ids[0], values[0], ranks[0]
