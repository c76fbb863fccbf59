"""The batched LoRA computation: each adapted layer holds `max_loras` slots of stacked A/B matrices; a step's
tokens are grouped by slot once (LoRAContext), and every layer adds expand(shrink(x_g A_s^T) B_s^T) for each
group g of slot s: one pair of small GEMMs per adapter in the step, never a loop over requests."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import lora_ref
from kernels.backend import use_triton
from kernels.cpu_features import matmul_dtype


@dataclass
class LoRAContext:
    """Which rows of this step's tokens (and of the logits being computed) run with which slot: shared by every
    adapted layer of the model and set by the runner before each forward / logits computation. Token groups are
    also kept as one order of the adapted tokens, sorted by slot, with each slot's run in it: a layer gathers its
    adapted rows once and scatters their deltas once. Off the CPU each token's slot is also written into
    `token_slots`, a persistent device buffer (-1 past the step's tokens) that the Triton path and the CUDA graphs
    captured over it read: a graph replays with whatever slots were written before it."""

    token_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    row_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    token_order: torch.Tensor | None = None  # adapted token rows, grouped by slot
    token_runs: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end) in token_order
    token_slots: torch.Tensor | None = None  # [capacity] int32 on the device, or None on the CPU
    oversized_slots: torch.Tensor | None = None  # a step's slots when they outnumber the buffer (eager steps only)
    written: int = 0  # entries of token_slots the last step set (the rest hold -1)
    # The Triton path's rows grouped by slot, per row count: one grouping per forward pass (new_forward empties it)
    row_blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def set_tokens(self, slots: list[int], device: torch.device) -> None:
        self.token_groups = self.groups_of(slots, device)
        self.token_order = torch.cat([rows for _, rows in self.token_groups]) if self.token_groups else None
        sizes = [rows.numel() for _, rows in self.token_groups]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.token_runs = [(slot, start, start + size) for (slot, _), start, size in
                           zip(self.token_groups, starts, sizes)]
        if self.token_slots is not None:
            self._write_slots(slots, device)
            self.new_forward()

    def new_forward(self) -> None:
        """Called as each forward pass starts (a CUDA graph's capture included, so the graph regroups its rows on
        every replay)."""
        self.row_blocks.clear()

    def _write_slots(self, slots: list[int], device: torch.device) -> None:
        """The step's slots into the buffer, the previous step's surplus reset to -1 (so padding rows of a graph
        run the base model); a step larger than the buffer gets a tensor of its own."""
        self.oversized_slots = None
        if len(slots) > self.token_slots.numel():
            self.oversized_slots = torch.tensor(slots, dtype=torch.int32, device=device)
            return
        values = slots + [-1] * (self.written - len(slots))
        if values:
            self.token_slots[:len(values)].copy_(torch.tensor(values, dtype=torch.int32), non_blocking=True)
        self.written = len(slots)

    def slots_of_rows(self, num_rows: int) -> torch.Tensor:
        """The slot of each of the first `num_rows` tokens, on the device (-1: none)."""
        if self.oversized_slots is not None and self.oversized_slots.numel() == num_rows:
            return self.oversized_slots
        if num_rows > self.token_slots.numel():  # a pass over rows of no step (a profiling run): no adapter
            return torch.full((num_rows,), -1, dtype=torch.int32, device=self.token_slots.device)
        return self.token_slots[:num_rows]

    @staticmethod
    def groups_of(slots: list[int], device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """(slot, row indices) for each slot >= 0 among per-row slots (-1: the base model)."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        return [(slot, torch.tensor(rows, dtype=torch.long, device=device)) for slot, rows in sorted(by_slot.items())]


class LoRALayerSlots:
    """A linear layer's adapter slots. A merged projection's parts (q/k/v) are stacked: A [slots, parts * rank, K]
    and a block-diagonal B [slots, N, parts * rank], zero where an adapter does not touch a part, so a group's delta
    is two GEMMs whatever the parts. `row_parallel` layers: x is this rank's share of the input, and the delta a
    partial sum like the base product (added before the all-reduce)."""

    def __init__(self, context: LoRAContext, part_sizes: list[int], input_size: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.context, self.max_rank = context, max_rank
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes) + 1)]
        parts = len(part_sizes)
        compute = matmul_dtype(dtype, device)  # kept in the GEMM dtype: nothing converted per step
        self.a = torch.zeros(max_loras, parts * max_rank, input_size, dtype=compute, device=device)
        self.b = torch.zeros(max_loras, self.offsets[-1], parts * max_rank, dtype=compute, device=device)
        self.used = torch.zeros(max_loras, dtype=torch.bool)  # which slots hold an adapter (the C++ layer reads it)
        # The C++ layer's (CPU) copy of b, transposed: a tile of outputs reads each column contiguously; the parts'
        # offsets let it skip b's zero blocks.
        self.b_t = self.b.transpose(1, 2).contiguous() if device.type == "cpu" else None
        self.part_offsets = torch.tensor(self.offsets, dtype=torch.int64)

    def set(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part` of the adapter in `slot` (its rank may be below max_rank: the rest stays zero)."""
        rank, first = a.shape[0], part * self.max_rank
        self.a[slot, first:first + rank].copy_(a)
        self.b[slot, self.offsets[part]:self.offsets[part + 1], first:first + rank].copy_(b)
        if self.b_t is not None:
            self.b_t[slot].copy_(self.b[slot].t())
        self.used[slot] = True

    def clear(self, slot: int) -> None:
        """The slot's weights zeroed (a slot without an adapter holds zeros): the Triton path multiplies every
        adapted row by its slot's weights whether or not the slot's adapter touches this layer."""
        self.used[slot] = False
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + each token's adapter delta (out unchanged when no adapted token runs through this layer)."""
        context = self.context
        compute = self.a.dtype
        if use_triton(x):
            from kernels import lora_triton  # triton is optional: imported only on CUDA

            # Every row through the kernels, whichever slots the step holds (capture-safe): rows of no adapter, and
            # slots whose adapter leaves this layer alone (zeroed weights), add zero.
            out = out.to(compute).contiguous()
            x2 = x.reshape(-1, x.shape[-1])
            blocks = context.row_blocks.get(x2.shape[0])
            if blocks is None:
                blocks = lora_triton.row_blocks(context.slots_of_rows(x2.shape[0]), self.a.shape[0])
                context.row_blocks[x2.shape[0]] = blocks
            lora_triton.add_lora(x2.to(compute), self.a, self.b, blocks, out.view(-1, out.shape[-1]))
            return out.to(x.dtype)
        runs = [run for run in context.token_runs if bool(self.used[run[0]])]
        if not runs:
            return out
        out = out.to(compute)  # the layer's fresh output (or a float32 copy of it): added to in place
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        adapted = x2.index_select(0, context.token_order).to(compute)
        delta = lora_ref.lora_delta(adapted, self.a, self.b, runs)
        out2.index_add_(0, context.token_order, delta)
        return out.to(x.dtype)


class SavedModuleSlots:
    """An adapter's own embeddings or LM head (PEFT's modules_to_save), whole, per slot: the rows of its tokens (or
    logits) are looked up in (multiplied by) its table instead of the model's."""

    def __init__(self, context: LoRAContext, max_loras: int) -> None:
        self.context = context
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
