"""A step's LoRA deltas for tokens grouped by adapter slot: delta[run] = (x[run] A_s^T) B_s^T for each run of slot
s (torch; kernels/lora_triton.py is its CUDA twin)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

Runs = list[tuple[int, int, int]]  # (slot, start, end) over the rows of x, in slot order


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, runs: Runs) -> torch.Tensor:
    """x [T, K] (rows grouped by run), a [slots, R, K], b [slots, N, R] → delta [T, N] (zero outside the runs).
    Runs of similar length are padded to the longest and multiplied by two batched GEMMs; otherwise (one run,
    or lengths too uneven to pad) a pair of GEMMs per run."""
    longest = max((end - start for _, start, end in runs), default=0)
    if len(runs) > 1 and longest * len(runs) <= 2 * x.shape[0]:
        return _batched(x, a, b, runs, longest)
    delta = x.new_zeros(x.shape[0], b.shape[1])
    for slot, start, end in runs:
        delta[start:end] = F.linear(F.linear(x[start:end], a[slot]), b[slot])
    return delta


def _batched(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, runs: Runs, longest: int) -> torch.Tensor:
    padded = x.new_zeros(len(runs), longest, x.shape[1])
    for index, (_, start, end) in enumerate(runs):
        padded[index, :end - start] = x[start:end]
    slots = [slot for slot, _, _ in runs]
    if slots == list(range(slots[0], slots[0] + len(slots))):  # consecutive slots: a view, no copy of weights
        a, b = a[slots[0]:slots[0] + len(slots)], b[slots[0]:slots[0] + len(slots)]
    else:
        index = torch.tensor(slots, device=x.device)
        a, b = a[index], b[index]
    expanded = torch.bmm(torch.bmm(padded, a.transpose(1, 2)), b.transpose(1, 2))
    delta = x.new_zeros(x.shape[0], b.shape[1])
    for index, (_, start, end) in enumerate(runs):
        delta[start:end] = expanded[index, :end - start]
    return delta
