"""Rows sorted into blocks of one group each (a MoE expert, a LoRA slot) on the device: the sizes of every output
depend only on the input's shape, so a CUDA graph can hold the sort and the grouped kernels launched over it."""
from __future__ import annotations

import torch


def max_blocks(num_rows: int, num_groups: int, block: int) -> int:
    """The most blocks `num_rows` rows over `num_groups` groups can fill, each group's run padded to `block`: at most
    min(rows, groups) groups have rows, each wasting at most block - 1 slots."""
    return -(-(num_rows + min(num_rows, num_groups) * (block - 1)) // block)


def group_blocks(group_of_row: torch.Tensor, num_groups: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """group_of_row [rows] (values outside [0, num_groups): the row belongs to no group) → (row ids [blocks * block]
    int32, sorted by group, each group's run padded to `block` with the id `rows`; the group of each block [blocks]
    int32, `num_groups` for the blocks past the last group's, which a kernel skips), blocks = max_blocks(...).

    No value reaches the host: counts by scatter_add (torch.bincount sizes its output from the data), places by
    cumulative sums, each block's group by a search in the groups' block ends."""
    num_rows, device = group_of_row.numel(), group_of_row.device
    num_blocks = max_blocks(num_rows, num_groups, block)
    member = (group_of_row >= 0) & (group_of_row < num_groups)
    key = torch.where(member, group_of_row, num_groups).long()  # non-members sort last, into group num_groups
    counts = torch.zeros(num_groups + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))
    blocks = (counts[:num_groups] + block - 1) // block
    block_ends = torch.cumsum(blocks, 0)
    padded_starts = torch.cat((block_ends.new_zeros(1), block_ends)) * block  # group num_groups: past every block
    first_sorted = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank_in_group = torch.arange(num_rows, device=device) - first_sorted[sorted_key]
    # Non-members land in the slot past the end, dropped below.
    place = torch.where(sorted_key < num_groups, padded_starts[sorted_key] + rank_in_group, num_blocks * block)
    rows = torch.full((num_blocks * block + 1,), num_rows, dtype=torch.int32, device=device)
    rows.scatter_(0, place, order.to(torch.int32))
    block_group = torch.searchsorted(block_ends, torch.arange(num_blocks, device=device), right=True)
    return rows[:-1], block_group.to(torch.int32)
