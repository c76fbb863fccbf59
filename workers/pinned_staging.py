"""Host-to-GPU copies of a step's index arrays through pinned buffers allocated once, without blocking."""
from __future__ import annotations

import numpy as np
import torch

from ipc import EngineConfig

_ALIGNMENT = 16  # bytes; every staged array starts at a multiple of this


class PinnedStaging:
    """Two pinned byte buffers used on alternate steps: a step's arrays are packed into one while the copies
    queued from the other may still be running, and a buffer is rewritten only after the event recorded behind
    its last copies has completed (so the host may run a step ahead of the GPU, never two)."""

    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        self.device = device
        self.buffers = [torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.copies_done = [torch.cuda.Event(), torch.cuda.Event()]
        self.current = 0
        self.used = 0

    def begin_step(self) -> None:
        """Close the current buffer's copies behind an event and switch to the other buffer once its copies ran."""
        self.copies_done[self.current].record()
        self.current ^= 1
        self.copies_done[self.current].synchronize()
        self.used = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A new device tensor holding `array` (same shape and dtype), its copy queued on the current stream."""
        return self._stage(array).to(self.device, non_blocking=True)

    def copy_into(self, target: torch.Tensor, array: np.ndarray) -> None:
        """Queue a copy of `array` into the device tensor `target` (same shape; e.g. a CUDA graph's input)."""
        target.copy_(self._stage(array), non_blocking=True)

    def _stage(self, array: np.ndarray) -> torch.Tensor:
        """`array` copied into this step's pinned buffer, as a tensor view of it."""
        array = np.ascontiguousarray(array)
        start = -(-self.used // _ALIGNMENT) * _ALIGNMENT
        end = start + array.nbytes
        buffer = self.buffers[self.current]
        if end > buffer.numel():
            raise RuntimeError(f"a step's index arrays need more than the {buffer.numel()} pinned bytes staged for "
                               "them: the staging capacity is computed too small")
        self.used = end
        staged = buffer[start:end].view(torch.from_numpy(array).dtype).view(array.shape)
        staged.numpy()[...] = array
        return staged


def staging_bytes(config: EngineConfig) -> int:
    """Pinned bytes for the most one step stages, each array aligned: four int64 arrays indexed by token (ids,
    positions, slots, prompt-logprob rows; a padded decode batch may exceed the token budget, never max_num_seqs),
    the block table, the logits indices, and the int32 query starts and lengths; and a decode batch launched ahead
    (ids, positions, slots, block table, int32 lengths)."""
    rows, seqs = max(config.max_num_batched_tokens, config.max_num_seqs), config.max_num_seqs
    table = seqs * -(-config.max_model_len // config.block_size)
    return (8 * (4 * rows + table + seqs) + 4 * (2 * seqs + 1) + 16 * (seqs + 8) + 8 * (3 * seqs + table) + 4 * seqs
            + 16 * 5)
