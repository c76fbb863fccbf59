"""DeepSeek-V3's multi-token-prediction layer in the C++ kernels (kernels/csrc/mtp_drafts.h): its input rows
(eh_proj over [enorm(embedding) | hnorm(hidden state)]) for its steps in Python, and the layer as the drafter of a
multi-step call's C++ steps (kernels.cpu_greedy_decode), which then drafts from the target's hidden states as
workers/spec_decode/mtp.py does."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels import cpu_extension, cpu_gemv
from kernels.cpu_layer_weights import pointer

if TYPE_CHECKING:
    from kernels.cpu_greedy_decode import GreedyModel


@dataclass(frozen=True)
class MtpParts:
    """The layer's parts around its decoder layer: the embedding table [vocab, hidden], enorm's and hnorm's RMSNorm
    weights (of eps), eh_proj [hidden, 2 hidden] and its kernels.cpu_gemv.pair_weight copy where kept; one dtype."""

    embedding: torch.Tensor
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eps: float
    eh_proj: torch.Tensor
    eh_pairs: torch.Tensor | None = None

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether the kernel computes them in `dtype`: CPU tensors of it, contiguous, of matching shapes."""
        hidden = self.embedding.shape[1]
        tensors = (self.embedding, self.enorm, self.hnorm, self.eh_proj)
        return (all(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
                and dtype in (torch.float32, torch.bfloat16) and self.enorm.shape == self.hnorm.shape == (hidden,)
                and self.eh_proj.shape == (hidden, 2 * hidden)
                and (self.eh_pairs is None or (dtype == torch.bfloat16 and cpu_gemv.pairs_serve(self.eh_proj)
                                               and cpu_gemv.fits_pairs(self.eh_proj, self.eh_pairs))))

    def args(self) -> tuple:
        """module.cpp's MtpInputsArgs."""
        return (self.embedding.data_ptr(), self.enorm.data_ptr(), self.hnorm.data_ptr(), self.eps,
                self.eh_proj.data_ptr(), pointer(self.eh_pairs), self.embedding.shape[1])


def mtp_inputs(parts: MtpParts, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's input rows for tokens [R] with the hidden states [R, hidden] before them, as the C++ steps
    compute them (parts.takes(hidden.dtype) holds)."""
    module = cpu_extension.load()
    tokens = tokens.to(torch.int64).contiguous()
    hidden = hidden.contiguous()
    if hidden.shape != (len(tokens), parts.embedding.shape[1]) or not parts.takes(hidden.dtype):
        raise ValueError("the MTP layer's input takes [rows, hidden] hidden states of its parts' dtype, one per token")
    if len(tokens) and not (0 <= int(tokens.min()) and int(tokens.max()) < parts.embedding.shape[0]):
        raise ValueError("a token outside the embedding's rows")
    x = torch.empty_like(hidden)
    module.mtp_inputs(hidden.dtype == torch.bfloat16, parts.args(), tokens.data_ptr(), hidden.data_ptr(),
                      len(tokens), x.data_ptr())
    return x


@dataclass(frozen=True)
class MtpDrafts:
    """Drafts that greedy_decode() has the MTP layer write, up to k per step, as MtpProposer drafts them: the first
    from a row's seed (the layer's output at the position before its last token's, seeds [rows, hidden] of the
    layer's dtype, where seeded[m] is 1), each next from the layer fed the draft before; after each step the layer
    takes every row's hidden states with the tokens then known after them, and the row's last output becomes its
    seed (seeds and seeded are updated in place). model: the layer's decoder layer prepared with the shared head's
    norm as its final norm, the embedding and the shared head; capacity: int64 [rows], the positions each row's
    blocks and the model length give (a row drafts with k slots from its last token on). drafting False: the steps
    verify no drafts, but the layer still takes their hidden states (as the Python steps of a batch past
    speculation's cut-off)."""

    k: int
    model: GreedyModel
    parts: MtpParts
    seeds: torch.Tensor
    seeded: np.ndarray
    capacity: np.ndarray
    drafting: bool = True

    @property
    def history(self) -> Sequence[Sequence[int]]:
        """No row's tokens (PromptLookupDrafts' history): the layer drafts from hidden states, not from them."""
        return [()] * len(self.seeded)

    def args(self, target: GreedyModel) -> tuple:
        """module.cpp's DraftArgs, once the layer is found to fit the target's steps."""
        model, rows, dtype = self.model, len(self.seeded), target.prepared.dtype
        model.check()
        if model.prepared.dtype != dtype or not self.parts.takes(dtype):
            raise TypeError(f"the MTP layer must be prepared for the target's {dtype}")
        if model.vocab_size != target.vocab_size or model.prepared.block_size != target.prepared.block_size:
            raise ValueError("the MTP layer needs the target's vocabulary and block size")
        hidden = self.parts.embedding.shape[1]
        if not (self.seeds.dtype == dtype and self.seeds.is_contiguous() and self.seeds.shape == (rows, hidden)):
            raise ValueError(f"seeds must be a contiguous [{rows}, {hidden}] tensor of {dtype}")
        for name in ("seeded", "capacity"):
            array = getattr(self, name)
            if not (isinstance(array, np.ndarray) and array.dtype == np.int64 and array.flags.c_contiguous
                    and array.flags.writeable and array.shape == (rows,)):
                raise ValueError(f"{name} must be a writable contiguous int64 array of shape ({rows},)")
        return (model.args(), self.capacity.ctypes.data, 0, 0,
                (self.parts.args(), self.seeds.data_ptr(), self.seeded.ctypes.data, self.drafting))
