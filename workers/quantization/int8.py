"""Online int8 weight-only quantization: each linear weight row scaled symmetrically into [-127, 127] (one float32
scale per output channel); activations stay in the model dtype. Embeddings and the LM head stay unless asked."""
from __future__ import annotations

import torch
from torch import nn

from workers.layers.linear import ColumnParallelLinear, Linear
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


@torch.no_grad()
def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (int8 [N, K], float32 scale [N]) with weight ≈ q * scale[:, None]; round to nearest."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8), scale


def quantize_int8_model(model: nn.Module, quantize_lm_head: bool) -> None:
    """Every quantizable linear layer's weight to int8 (router gates and the like opt out); with
    `quantize_lm_head` the LM head too, and with it the embedding table when the two are tied."""
    for module in list(model.modules()):
        if isinstance(module, (Linear, ColumnParallelLinear)) and module.quantizable:
            _quantize(module)
    lm_head = getattr(model, "lm_head", None)
    if quantize_lm_head and isinstance(lm_head, ParallelLMHead):
        tied = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and m.weight is lm_head.weight]
        _quantize(lm_head)
        for embedding in tied:
            if embedding is not lm_head:
                embedding.weight, embedding.weight_scale = lm_head.weight, lm_head.weight_scale


def _quantize(module: nn.Module) -> None:
    q, scale = quantize_rows(module.weight.data)
    module.weight = nn.Parameter(q, requires_grad=False)
    module.weight_scale = scale
