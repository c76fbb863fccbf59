"""Online weight quantization at load: each linear weight row scaled symmetrically into int8's [-127, 127] or fp8
e4m3's [-448, 448] (one float32 scale per output channel). Embeddings and the LM head stay unless asked."""
from __future__ import annotations

import torch
from torch import nn

from workers.distributed import tp_all_reduce_max
from workers.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


# The largest magnitude of each storage type: a row's largest weight maps onto it.
RANGE = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@torch.no_grad()
def quantize_rows(weight: torch.Tensor, row_parallel: bool = False, dtype: torch.dtype = torch.int8
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q [N, K] of `dtype`, float32 scale [N]) with weight ≈ q * scale[:, None], rounded to the
    nearest value of `dtype` (int8 or float8_e4m3fn). row_parallel: K is this rank's share of the row, whose scale
    comes from the whole row (max over the TP ranks), so every TP size quantizes alike."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    if row_parallel:
        amax = tp_all_reduce_max(amax)
    scale = torch.where(amax > 0, amax / RANGE[dtype], torch.ones_like(amax))
    scaled = (w / scale.unsqueeze(1)).clamp_(-RANGE[dtype], RANGE[dtype])
    return (torch.round(scaled) if dtype == torch.int8 else scaled).to(dtype), scale


def quantize_model_rows(model: nn.Module, quantize_lm_head: bool, dtype: torch.dtype = torch.int8) -> None:
    """Every quantizable linear layer's weight to `dtype` (router gates and the like opt out); with
    `quantize_lm_head` the LM head too, and the embedding table when the model ties the two (on every pipeline
    stage that holds either, so that stages split anywhere compute what one rank does)."""
    for module in list(model.modules()):
        if isinstance(module, (Linear, ColumnParallelLinear)) and module.quantizable:
            _quantize(module, dtype)
    if not quantize_lm_head:
        return
    tied = getattr(model, "tie_word_embeddings", False)
    tables = [m for m in model.modules() if isinstance(m, ParallelLMHead)
              or (tied and isinstance(m, VocabParallelEmbedding))]
    done: dict[int, nn.Module] = {}  # one table shared by the head and the embeddings is quantized once
    for table in tables:
        first = done.setdefault(id(table.weight), table)
        if first is table:
            _quantize(table, dtype)
        else:
            table.weight, table.weight_scale = first.weight, first.weight_scale


def _quantize(module: nn.Module, dtype: torch.dtype) -> None:
    q, scale = quantize_rows(module.weight.data, isinstance(module, RowParallelLinear), dtype)
    module.weight = nn.Parameter(q, requires_grad=False)
    module.weight_scale = scale
