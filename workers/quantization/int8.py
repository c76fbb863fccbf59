"""Online int8 weight-only quantization: each linear weight row scaled symmetrically into [-127, 127] (one float32
scale per output channel); activations stay in the model dtype. Embeddings and the LM head stay unless asked."""
from __future__ import annotations

import torch
from torch import nn

from workers.distributed import tp_all_reduce_max
from workers.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


@torch.no_grad()
def quantize_rows(weight: torch.Tensor, row_parallel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (int8 [N, K], float32 scale [N]) with weight ≈ q * scale[:, None]; round to nearest.
    row_parallel: K is this rank's share of the row, whose scale comes from the whole row (max over the TP ranks),
    so every TP size quantizes alike."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    if row_parallel:
        amax = tp_all_reduce_max(amax)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8), scale


def quantize_int8_model(model: nn.Module, quantize_lm_head: bool) -> None:
    """Every quantizable linear layer's weight to int8 (router gates and the like opt out); with
    `quantize_lm_head` the LM head too, and the embedding table when the model ties the two (on every pipeline
    stage that holds either, so that stages split anywhere compute what one rank does)."""
    for module in list(model.modules()):
        if isinstance(module, (Linear, ColumnParallelLinear)) and module.quantizable:
            _quantize(module)
    if not quantize_lm_head:
        return
    tied = getattr(model, "tie_word_embeddings", False)
    tables = [m for m in model.modules() if isinstance(m, ParallelLMHead)
              or (tied and isinstance(m, VocabParallelEmbedding))]
    done: dict[int, nn.Module] = {}  # one table shared by the head and the embeddings is quantized once
    for table in tables:
        first = done.setdefault(id(table.weight), table)
        if first is table:
            _quantize(table)
        else:
            table.weight, table.weight_scale = first.weight, first.weight_scale


def _quantize(module: nn.Module) -> None:
    q, scale = quantize_rows(module.weight.data, row_parallel=isinstance(module, RowParallelLinear))
    module.weight = nn.Parameter(q, requires_grad=False)
    module.weight_scale = scale
