"""Vocab-parallel embedding and LM head: each TP rank holds a contiguous slice of the vocabulary's rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import parallel_state, tp_all_reduce, tp_gather_last_dim
from workers.layers.linear import Sliceable, linear


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the table; the last rank's slice is zero-padded so every rank holds the same shape."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        state = parallel_state()
        self.vocab_size, self.tp_size = vocab_size, state.tp_size
        rows_per_rank = -(-vocab_size // state.tp_size)
        self.start = state.tp_rank * rows_per_rank
        self.end = min(vocab_size, self.start + rows_per_rank)
        self.weight = nn.Parameter(torch.zeros(rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # Set when the table is quantized to int8 (an LM head tied to it, --quantize-lm-head): rows are then
        # dequantized into `dtype` as they are looked up.
        self.register_buffer("weight_scale", None, persistent=False)
        self.dtype = self.weight.dtype
        self.lora = None  # adapters' own tables (modules_to_save, workers.lora), once an adapter brings one

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: int | None = None) -> None:
        rows = loaded[self.start:self.end]
        if rows.shape[1:] != param.shape[1:] or rows.shape[0] != self.end - self.start:
            raise ValueError(f"checkpoint tensor rows {self.start}:{self.end} of shape {tuple(rows.shape)} do not "
                             f"fit parameter of shape {tuple(param.shape)}")
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            out = self._lookup(input_ids)
        else:
            mine = (input_ids >= self.start) & (input_ids < self.end)
            out = self._lookup(torch.where(mine, input_ids - self.start, 0))
            out = tp_all_reduce(out.masked_fill_(~mine.unsqueeze(-1), 0))
        return out if self.lora is None else self.lora.replace_embeddings(input_ids, out)

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is None:
            return F.embedding(rows, self.weight)
        return (self.weight[rows].float() * self.weight_scale[rows].unsqueeze(-1)).to(self.dtype)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden → logits over the full vocabulary, gathered on TP rank 0 (the rank that samples)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.packed_weight = None  # the weight prepacked for torch's CPU GEMMs (workers.prepacking), if kept
        self.pairs_weight = None  # ... and paired for the CPU's GEMV kernel (kernels.cpu_gemv.pair_weight)
        self.gemv_config = None  # the Triton GEMV's launch shape for one-row logits on CUDA (workers.gemv_tuning)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 [tokens, vocab] on TP rank 0; None on the other TP ranks (they only contribute)."""
        logits = linear(hidden, self.weight, None, self.weight_scale, packed=self.packed_weight,
                        pairs=self.pairs_weight, gemv=self.gemv_config)
        logits = tp_gather_last_dim(logits)
        if logits is None:
            return None
        logits = logits[:, :self.vocab_size].float()
        return logits if self.lora is None else self.lora.replace_logits(hidden, logits)


def tie_lm_head(lm_head: ParallelLMHead | None, embed_tokens: VocabParallelEmbedding | None,
                embed_name: str) -> dict[str, str]:
    """Share the embedding table with the head where this stage holds both. A last pipeline stage without the
    embeddings loads them from the checkpoint instead: the alias {embed_name: "lm_head.weight"} is returned."""
    if lm_head is None:
        return {}
    if embed_tokens is not None:
        lm_head.weight = embed_tokens.weight
        return {}
    return {embed_name: "lm_head.weight"}
