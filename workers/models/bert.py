"""BERT encoders: BertModel (sentence embeddings) and BertForSequenceClassification (cross-encoders). Each step's
sequences run whole, attending both ways within themselves; no KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from workers.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def check_bert_config(config: PretrainedConfig) -> None:
    """ValueError for what these classes do not compute as HF does."""
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported "
                         "(only 'absolute')")


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) \
            + self.position_embeddings(positions)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv = ColumnParallelLinear(config.hidden_size, [(config.num_attention_heads, self.head_dim)] * 3,
                                        bias=True)
        self.num_heads = self.qkv.output_sizes[0] // self.head_dim

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in self.qkv(x).chunk(3, dim=-1))
        return bidirectional_attention(q, k, v, seq_lens).flatten(1)


class BertLayer(nn.Module):
    """Self-attention then the MLP, each followed by its residual LayerNorm (post-norm)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.self_attn = BertSelfAttention(config)
        self.attention_dense = RowParallelLinear(hidden, hidden, bias=True)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = ColumnParallelLinear(hidden, [(config.intermediate_size, 1)], bias=True)
        self.output_dense = RowParallelLinear(config.intermediate_size, hidden, bias=True)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)
        self.activation = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        x = self.attention_norm(x + self.attention_dense(self.self_attn(x, seq_lens)))
        return self.output_norm(x + self.output_dense(self.activation(self.intermediate(x))))


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """Each sequence's tokens attend to all of its own ([tokens, heads, head_dim], sequences back to back). Equal
    lengths run as one batch; otherwise the sequences are padded to the longest and the padding masked."""
    longest = max(seq_lens)
    if longest * len(seq_lens) == q.shape[0]:
        q, k, v = (t.view(len(seq_lens), longest, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, *q.shape[1:2], q.shape[-1])
    lengths = torch.tensor(seq_lens, device=q.device)
    valid = torch.arange(longest, device=q.device) < lengths[:, None]  # [sequences, longest]
    padded = [t.new_zeros(len(seq_lens), longest, *t.shape[1:]) for t in (q, k, v)]
    for target, source in zip(padded, (q, k, v)):
        target[valid] = source
    q, k, v = (t.transpose(1, 2) for t in padded)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
    return out.transpose(1, 2)[valid]


class BertModel(nn.Module):
    """Token embeddings for every input token; sentence embeddings are pooled from them (workers.pooling)."""

    packed_modules = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
    # HF's module names → ours (the attention's three projections are one, see packed_modules).
    renamed_modules = {"attention.self": "self_attn", "attention.output.dense": "attention_dense",
                       "attention.output.LayerNorm": "attention_norm", "intermediate.dense": "intermediate",
                       "output.dense": "output_dense", "output.LayerNorm": "output_norm"}

    def __init__(self, config: PretrainedConfig, add_pooling_layer: bool = False) -> None:
        super().__init__()
        check_bert_config(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.pooler = BertPooler(config) if add_pooling_layer else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, seq_lens)
        return x


class BertPooler(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first_tokens))


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: [CLS] through BERT's pooler and a linear classifier; the logits are the output."""

    packed_modules = BertModel.packed_modules
    renamed_modules = BertModel.renamed_modules

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.bert = BertModel(config, add_pooling_layer=True)
        self.classifier = Linear(config.hidden_size, config.num_labels, bias=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        return self.bert(input_ids, positions, token_type_ids, seq_lens)

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(first_tokens))
