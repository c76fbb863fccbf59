"""Decode ahead: while the host turns a CUDA-graph decode step's tokens into outputs and schedules the next step,
the GPU already runs the next step's forward pass for the same requests, one position on, fed the tokens just
sampled on the device. The next step takes those hidden states where it decodes the same requests (or some of
them) from the same inputs, and computes its own otherwise."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.cuda_graphs import DecodeBatch, DecodeGraphs
from workers.pinned_staging import PinnedStaging


@dataclass
class DecodeRows:
    """A decode-only step's host arrays, one row per request (no padding rows)."""

    req_ids: list[str]
    positions: np.ndarray  # [n] int64
    slot_mapping: np.ndarray  # [n] int64
    seq_lens: np.ndarray  # [n]
    block_tables: np.ndarray  # [n, blocks] int64, zero past each request's own blocks
    num_blocks: np.ndarray  # [n]: the blocks each request holds


def next_rows(rows: DecodeRows, block_size: int, max_model_len: int) -> DecodeRows | None:
    """The same requests one position on; None where a request would pass max_model_len or the slot of its next
    token lies in a block it does not hold yet."""
    positions = rows.positions + 1
    block_index = positions // block_size
    if (positions >= max_model_len).any() or (block_index >= rows.num_blocks).any():
        return None
    slots = rows.block_tables[np.arange(len(positions)), block_index] * block_size + positions % block_size
    return DecodeRows(rows.req_ids, positions, slots, rows.seq_lens + 1, rows.block_tables, rows.num_blocks)


@dataclass
class AheadForward:
    """A forward pass launched ahead: its rows, and the graph's output, valid until the next replay."""

    rows: DecodeRows
    hidden: torch.Tensor  # [graph size, hidden]; row i is rows.req_ids[i]'s
    # The tokens it was fed, known on the host once the step that sampled them returned (None until then).
    token_ids: np.ndarray | None = None

    def rows_for(self, rows: DecodeRows, input_ids: np.ndarray, block_size: int) -> np.ndarray | None:
        """Where each of `rows` sits in the hidden states, if every one was computed ahead from exactly these
        inputs (token, position, KV slot, length, the blocks its attention reads); else None."""
        if self.token_ids is None:
            return None
        index = {req_id: i for i, req_id in enumerate(self.rows.req_ids)}
        picked = np.array([index.get(req_id, -1) for req_id in rows.req_ids], dtype=np.int64)
        if (picked < 0).any():
            return None
        ahead = self.rows
        same = (np.array_equal(self.token_ids[picked], input_ids)
                and np.array_equal(ahead.positions[picked], rows.positions)
                and np.array_equal(ahead.slot_mapping[picked], rows.slot_mapping)
                and np.array_equal(ahead.seq_lens[picked], rows.seq_lens))
        if not same:
            return None
        used = -(-rows.seq_lens.astype(np.int64) // block_size)
        width = int(used.max())
        if width > min(ahead.block_tables.shape[1], rows.block_tables.shape[1]):
            return None
        read = np.arange(width) < used[:, None]
        if not np.array_equal(np.where(read, rows.block_tables[:, :width], 0),
                              np.where(read, ahead.block_tables[picked, :width], 0)):
            return None
        return picked


def launch_ahead(graphs: DecodeGraphs, staging: PinnedStaging | None, rows: DecodeRows, size: int,
                 tokens: torch.Tensor) -> tuple[torch.Tensor, AheadForward | None]:
    """With this step's tokens still on the device: replay the next decode step's graph (captured at `size`) for
    `rows`, fed those tokens; returns a host copy of the tokens queued before it, so reading them waits for this
    step's work alone (tolist() on the device tensor would wait for the whole stream), and the forward pass
    launched (None where a request's sampling failed: its row is gone)."""
    host_tokens = tokens.to("cpu", non_blocking=True)
    copied = torch.cuda.Event() if tokens.is_cuda else None  # on CPU, host_tokens is tokens
    if copied is not None:
        copied.record()
    ahead = None
    if len(tokens) == len(rows.req_ids):
        batch = DecodeBatch.padded(np.zeros(len(tokens), dtype=np.int64), rows.positions, rows.slot_mapping,
                                   rows.seq_lens, rows.block_tables, size)
        input_ids, _, _ = graphs.load(batch, staging)
        input_ids[:len(tokens)].copy_(tokens)
        ahead = AheadForward(rows, graphs.replay(size))
    if copied is not None:
        copied.synchronize()
    return host_tokens, ahead
