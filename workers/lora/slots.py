"""The batched LoRA computation: each adapted layer holds `max_loras` slots of stacked A/B matrices; a step's
tokens are grouped by slot once (LoRAContext), and every layer adds expand(shrink(x_g A_s^T) B_s^T) for each
group g of slot s: one pair of small GEMMs per adapter in the step, never a loop over requests."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cpu_features import matmul_dtype


@dataclass
class LoRAContext:
    """Which rows of this step's tokens (and of the logits being computed) run with which slot: shared by every
    adapted layer of the model and set by the runner before each forward / logits computation."""

    token_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    row_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @staticmethod
    def groups_of(slots: list[int], device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """(slot, row indices) for each slot >= 0 among per-row slots (-1: the base model)."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        return [(slot, torch.tensor(rows, dtype=torch.long, device=device)) for slot, rows in by_slot.items()]


class LoRALayerSlots:
    """A linear layer's adapter slots: per output part (q/k/v of a merged projection) A [slots, rank, K] and
    B [slots, N_part, rank], zero where an adapter does not touch that part. `row_parallel`: x is this rank's
    share of the input, and the delta is a partial sum like the base product (added before the all-reduce)."""

    def __init__(self, context: LoRAContext, part_sizes: list[int], input_size: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.context = context
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.a = [torch.zeros(max_loras, max_rank, input_size, dtype=dtype, device=device) for _ in part_sizes]
        self.b = [torch.zeros(max_loras, size, max_rank, dtype=dtype, device=device) for size in part_sizes]
        self.used = [[False] * len(part_sizes) for _ in range(max_loras)]  # slot, part → holds weights

    def set(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        rank = a.shape[0]
        self.a[part][slot].zero_()
        self.b[part][slot].zero_()
        self.a[part][slot, :rank].copy_(a)
        self.b[part][slot, :, :rank].copy_(b)
        self.used[slot][part] = True

    def clear(self, slot: int) -> None:
        self.used[slot] = [False] * len(self.used[slot])

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + each token's adapter delta (out unchanged when no adapted token runs through this layer)."""
        groups = [(slot, rows) for slot, rows in self.context.token_groups if any(self.used[slot])]
        if not groups:
            return out
        compute = matmul_dtype(x.dtype, x.device)
        out = out.to(compute)  # the layer's fresh output (or a float32 copy of it): added to in place
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for slot, rows in groups:
            xs = x2.index_select(0, rows).to(compute)
            delta = torch.zeros(rows.numel(), out2.shape[1], dtype=compute, device=out.device)
            for part, offset in enumerate(self.offsets):
                if self.used[slot][part]:
                    b = self.b[part][slot]
                    shrunk = F.linear(xs, self.a[part][slot].to(compute))
                    delta[:, offset:offset + b.shape[0]] = F.linear(shrunk, b.to(compute))
            out2.index_add_(0, rows, delta)
        return out.to(x.dtype)


class SavedModuleSlots:
    """An adapter's own embeddings or LM head (PEFT's modules_to_save), whole, per slot: the rows of its tokens (or
    logits) are looked up in (multiplied by) its table instead of the model's."""

    def __init__(self, context: LoRAContext, max_loras: int, logits: bool) -> None:
        self.context, self.logits = context, logits
        self.tables: list[torch.Tensor | None] = [None] * max_loras

    def set(self, slot: int, table: torch.Tensor) -> None:
        self.tables[slot] = table

    def clear(self, slot: int) -> None:
        self.tables[slot] = None

    def replace_embeddings(self, input_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for slot, rows in self.context.token_groups:
            if self.tables[slot] is not None:
                out[rows] = F.embedding(input_ids[rows], self.tables[slot]).to(out.dtype)
        return out

    def replace_logits(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        for slot, rows in self.context.row_groups:
            if self.tables[slot] is not None:
                compute = matmul_dtype(hidden.dtype, hidden.device)
                logits[rows] = F.linear(hidden[rows].to(compute), self.tables[slot].to(compute)).float()
        return logits
