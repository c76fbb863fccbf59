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


def rows_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, num_logprobs: dict[int, int]
                  ) -> dict[int, tuple[list[int], list[float], int]]:
    """logprobs [rows, vocab], tokens [rows]; row -> its ([token, top-n ...] ids, their logprobs, the token's rank) for
    each row that asks for n: one gather over the rows asking for the same n (each row's result as alone)."""
    by_n: dict[int, list[int]] = {}
    for row, n in num_logprobs.items():
        by_n.setdefault(n, []).append(row)
    out = {}
    for n, rows in by_n.items():
        index = torch.tensor(rows, device=logprobs.device)
        for row, ids, values, rank in zip(rows, *gather_logprobs(logprobs[index], tokens[index], n)):
            out[row] = (ids, values, rank)
    return out
