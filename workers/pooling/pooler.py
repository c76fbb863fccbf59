"""From a step's hidden states to each pooling request's result: its sequence pooled (CLS, MEAN or LAST), then
cut to `dimensions` and normalized (embeddings) or put through the classifier (logits); float32 bytes out."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ipc import PoolingInfo, PoolingParams


def pool_sequences(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """[sequences, hidden] from the rows of sequences laid back to back."""
    ends = torch.tensor(seq_lens, device=hidden.device).cumsum(0)
    if pooling_type == "LAST":
        return hidden[ends - 1]
    if pooling_type == "CLS":
        return hidden[ends - torch.tensor(seq_lens, device=hidden.device)]
    return torch.stack([rows.float().mean(0) for rows in hidden.split(seq_lens)]).to(hidden.dtype)


def finish_embedding(pooled: torch.Tensor, params: PoolingParams, info: PoolingInfo) -> bytes:
    """One sequence's embedding: its first `dimensions` values (Matryoshka), L2-normalized if asked."""
    vector = pooled.float()
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if info.normalize if params.normalize is None else params.normalize:
        vector = F.normalize(vector, dim=-1)
    return to_bytes(vector)


def to_bytes(vector: torch.Tensor) -> bytes:
    return vector.float().cpu().numpy().astype("<f4").tobytes()


@dataclass
class ChunkedPooling:
    """A decoder's pooling request computed over several steps (chunked prefill): what MEAN and CLS keep between
    its chunks. A chunk starting at position 0 starts over (a preempted request recomputes its prompt)."""

    pooling_type: str
    partial: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)  # request → (sum or first row, rows)

    def add(self, req_id: str, rows: torch.Tensor, start: int, is_last: bool) -> torch.Tensor | None:
        """Take the request's rows of this step; its pooled vector once the last chunk is in, else None."""
        if self.pooling_type == "LAST":
            return rows[-1] if is_last else None
        if start == 0:
            self.partial.pop(req_id, None)
        if self.pooling_type == "CLS":
            first, _ = self.partial.setdefault(req_id, (rows[0], 1))
            return self._done(req_id, first) if is_last else None
        total, count = self.partial.get(req_id, (0.0, 0))
        self.partial[req_id] = (rows.float().sum(0) + total, count + len(rows))
        return self._done(req_id, self.partial[req_id][0] / self.partial[req_id][1]) if is_last else None

    def forget(self, req_id: str) -> None:
        self.partial.pop(req_id, None)

    def _done(self, req_id: str, vector: torch.Tensor) -> torch.Tensor:
        del self.partial[req_id]
        return vector
