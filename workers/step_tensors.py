"""A step's index arrays as the model's device takes them (shared with numpy on CPU, staged through pinned memory on
CUDA), its block table and its attention metadata."""
from __future__ import annotations

import numpy as np
import torch

from workers.layers.attention import AttentionMetadata
from workers.pinned_staging import PinnedStaging
from workers.request_state import CachedRequestState


class StepTensors:
    def __init__(self, block_size: int, staging: PinnedStaging | None) -> None:
        self.block_size, self.staging = block_size, staging

    def attention_metadata(self, slot_mapping: np.ndarray, table: np.ndarray, query_start_loc: np.ndarray,
                            seq_lens: np.ndarray, num_decodes: int) -> AttentionMetadata:
        metadata = AttentionMetadata(
            slot_mapping=self.indices(slot_mapping), block_tables=self.indices(table),
            query_start_loc=query_start_loc.tolist(), seq_lens=seq_lens.tolist(), num_decodes=num_decodes)
        if self.staging is not None:  # the kernels' int32 copies, made once for every layer
            metadata.device_query_start_loc = self.staging.to_device(query_start_loc.astype(np.int32))
            metadata.device_seq_lens = self.staging.to_device(seq_lens.astype(np.int32))
        return metadata

    def block_table(self, states: list[CachedRequestState]) -> tuple[np.ndarray, np.ndarray]:
        """The step's block table (zero past each request's blocks) and how many blocks each request holds."""
        num_blocks = np.array([len(s.block_ids) for s in states], dtype=np.int64)
        table = np.zeros((len(states), num_blocks.max()), dtype=np.int64)
        for row, state in enumerate(states):
            table[row, :len(state.block_ids)] = state.block_ids
        return table, num_blocks

    def indices(self, array: np.ndarray) -> torch.Tensor:
        """An int64 index array on this rank's device: shared with numpy on CPU, staged through pinned memory on
        CUDA."""
        array = np.ascontiguousarray(array, dtype=np.int64)
        return torch.from_numpy(array) if self.staging is None else self.staging.to_device(array)
