"""CUDA graphs for decode-only batches: one per batch size, captured at start-up into one shared memory pool,
replayed with the batch padded up to the next captured size (logits and sampling run outside, on real rows)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ipc import EngineConfig
from kernels import decode_splits
from workers.layers.attention import DecodeMetadata
from workers.pinned_staging import PinnedStaging

_LARGEST_DEFAULT_SIZE = 512
# Runs before each capture: they compile the Triton kernels and create cuBLAS state, none of which may happen
# while a graph is being captured.
_WARMUP_RUNS = 2


def capture_sizes(config: EngineConfig) -> list[int]:
    """Ascending batch sizes to capture: config.cuda_graph_sizes, or vLLM's default 1, 2, 4, 8 and multiples of 8
    up to min(max_num_seqs, 512); none above max_num_seqs, nor above the size that the largest decode batch
    (one token per sequence, within max_num_batched_tokens) pads to."""
    sizes = config.cuda_graph_sizes
    if sizes is None:
        sizes = [1, 2, 4, *range(8, min(config.max_num_seqs, _LARGEST_DEFAULT_SIZE) + 1, 8)]
    sizes = sorted({size for size in sizes if size <= config.max_num_seqs})
    largest = padded_batch_size(min(config.max_num_seqs, config.max_num_batched_tokens), sizes)
    return [size for size in sizes if largest is None or size <= largest]


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest of the ascending captured sizes that holds num_seqs rows; None if none does (run eagerly)."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass
class DecodeBatch:
    """A decode-only step's rows padded to a captured size: what is copied into the graph's static inputs."""

    input_ids: np.ndarray  # [size] int64
    positions: np.ndarray  # [size] int64
    slot_mapping: np.ndarray  # [size] int64
    seq_lens: np.ndarray  # [size] int32
    block_tables: np.ndarray  # [size, blocks of the longest context] int64

    @classmethod
    def padded(cls, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, seq_lens: np.ndarray,
               block_tables: np.ndarray, size: int) -> DecodeBatch:
        """Rows past the real ones read token 0 at position 0, write no KV (slot -1) and attend one key of
        block 0: valid work whose output no one reads."""
        pad = size - len(input_ids)
        return cls(np.pad(input_ids, (0, pad)), np.pad(positions, (0, pad)),
                   np.pad(slot_mapping, (0, pad), constant_values=-1),
                   np.pad(seq_lens, (0, pad), constant_values=1).astype(np.int32),
                   np.pad(block_tables, ((0, pad), (0, 0))))


class DecodeGraphs:
    """Static inputs sized for the largest captured batch (the graph of size n reads their first n rows) and one
    graph per size. The graphs share one memory pool: only one runs at a time, and each one's output is read
    before the next replay."""

    def __init__(self, model: nn.Module, sizes: list[int], max_model_len: int, block_size: int, num_kv_heads: int,
                 device: torch.device) -> None:
        self.model, self.sizes, self.device = model, sizes, device
        largest = sizes[-1]
        # The values a padding row holds, so warm-up and capture runs write nothing to the KV cache.
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(largest, -(-max_model_len // block_size), dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        # Contexts are unknown when a graph is captured: split as for the longest ones a batch could hold.
        self.num_splits = {size: decode_splits(size, max_model_len, num_kv_heads, device) for size in sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so the smaller graphs reuse the pool memory the largest one reserved."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._capture(size, pool)

    def _capture(self, size: int, pool: tuple[int, int]) -> None:
        args = (self.input_ids[:size], self.positions[:size], self.metadata(size))
        warmup = torch.cuda.Stream(self.device)
        warmup.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(warmup):
            for _ in range(_WARMUP_RUNS):
                self.model(*args)
        torch.cuda.current_stream(self.device).wait_stream(warmup)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[size] = self.model(*args)
        self.graphs[size] = graph

    def metadata(self, size: int) -> DecodeMetadata:
        return DecodeMetadata(self.slot_mapping[:size], self.block_tables[:size], self.query_start_loc[:size + 1],
                              self.seq_lens[:size], self.num_splits[size])

    def load(self, batch: DecodeBatch, staging: PinnedStaging) -> tuple[torch.Tensor, torch.Tensor, DecodeMetadata]:
        """Queue the batch's copies into the static inputs; (input_ids, positions, metadata) of its graph."""
        size, width = batch.block_tables.shape
        staging.copy_into(self.input_ids[:size], batch.input_ids)
        staging.copy_into(self.positions[:size], batch.positions)
        staging.copy_into(self.slot_mapping[:size], batch.slot_mapping)
        staging.copy_into(self.seq_lens[:size], batch.seq_lens)
        staging.copy_into(self.block_tables[:size, :width], batch.block_tables)
        return self.input_ids[:size], self.positions[:size], self.metadata(size)

    def replay(self, size: int) -> torch.Tensor:
        """The hidden states [size, hidden] of the loaded batch (padding rows included), valid until the next
        replay of any graph."""
        self.graphs[size].replay()
        return self.outputs[size]
