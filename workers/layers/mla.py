"""Multi-head latent attention (DeepSeek-V2): the paged cache holds one compressed latent plus one rotary key per
token instead of keys and values per head; decodes attend over it absorbed, prefill chunks expand it."""
from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import PretrainedConfig

from kernels import cpu_gemv, matmul_dtype
from kernels.attention_ref import context_of, prefill_chunk
from workers.layers.attention import Attention, AttentionMetadata, StepMetadata
from workers.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, dequantized_weight
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding, rope_parameters_of, rope_type_of, yarn_mscale


class MLAAttention(nn.Module):
    """Per token the cache stores [kv_a_layernorm(c_kv) | rope(k_pe)], kv_lora_rank + qk_rope_head_dim values, as one
    KV head that serves as key and value.

    Decodes run absorbed: each head's no-rope query goes into the latent space through its slice of kv_b_proj
    (W_UK), so q · k = q_nope W_UK · c_kv + q_pe · k_pe, and the output over latents is projected to each head's
    value by W_UV; one latent row per context token is read. Prefill chunks run expanded: their context's latents
    through kv_b_proj into per-head keys and values, cheaper when many queries share them. Rotary pairs adjacent
    dims (DeepSeek's complex form): q_pe and k_pe are both kept with even dims first, where the rotate-half kernel
    computes the same rotation."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        bias = getattr(config, "attention_bias", False)
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, [(heads, qk_dim)])
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [(heads, qk_dim)])
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, [(heads, self.nope_dim + self.v_dim)])
        self.num_heads = self.kv_b_proj.output_sizes[0] // (self.nope_dim + self.v_dim)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, 1, self.kv_lora_rank + self.rope_dim, _softmax_scale(config, qk_dim),
                              shared_kv=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        q = self._q(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rotary(positions, _evens_first(q_pe), _evens_first(k_pe.unsqueeze(1)))
        latent = torch.cat((self.kv_a_layernorm(c_kv).unsqueeze(1), k_pe), dim=-1)  # [tokens, 1, lora + rope]
        self.attn.write_kv(latent, latent, metadata)
        if not isinstance(metadata, AttentionMetadata) or metadata.num_decodes == len(metadata.seq_lens):
            return self.o_proj(self._absorbed(q_nope, q_pe, metadata))
        split = metadata.query_start_loc[metadata.num_decodes]  # decode rows come first
        out = torch.empty(x.shape[0], self.num_heads * self.v_dim, dtype=x.dtype, device=x.device)
        if split:
            out[:split] = self._absorbed(q_nope[:split], q_pe[:split], _decodes_of(metadata))
        out[split:] = self._expanded(q_nope[split:], q_pe[split:], latent[split:], metadata)
        return self.o_proj(out)

    def _q(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    @property
    def q_projection(self) -> nn.Module:
        """The projection whose output is each head's query: q_proj, or V3's q_b_proj."""
        return self.q_proj if self.q_lora_rank is None else self.q_b_proj

    def fused_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The C++ layer's qkv rows (kernels/csrc/mla.h): [q | kv_a], as forward() projects them."""
        return torch.cat((self._q(x), self.kv_a_proj_with_mqa(x)), dim=-1)

    def fused_form(self) -> dict:
        """The MLA fields of kernels.cpu_layer_weights.DecoderLayerWeights, in the model dtype."""
        weight = dequantized_weight(self.kv_b_proj).to(self.kv_a_layernorm.weight.dtype)
        w_uk, w_uv = weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank).split(
            [self.nope_dim, self.v_dim], dim=1)
        q_lora = self.q_lora_rank is not None
        w_uk_t, w_uv = w_uk.transpose(1, 2).contiguous(), w_uv.contiguous()
        # Each head's pairs copies where the model's projections got theirs (workers.prepacking's budget and CPU).
        paired = self.kv_a_proj_with_mqa.pairs_weight is not None and cpu_gemv.pairs_serve(w_uk_t[0])
        return {"mla_q_a": self.q_a_proj.weight if q_lora else None, "mla_kv_a": self.kv_a_proj_with_mqa.weight,
                "mla_q_a_norm": self.q_a_layernorm.weight if q_lora else None,
                "mla_kv_norm": self.kv_a_layernorm.weight, "mla_w_uk_t": w_uk_t, "mla_w_uv": w_uv,
                "mla_eps": self.kv_a_layernorm.eps, "mla_q_a_pairs": self.q_a_proj.pairs_weight if q_lora else None,
                "mla_kv_a_pairs": self.kv_a_proj_with_mqa.pairs_weight,
                "mla_w_uk_t_pairs": _per_head_pairs(w_uk_t) if paired else None,
                "mla_w_uv_pairs": _per_head_pairs(w_uv) if paired else None}

    def takes_one_call(self) -> bool:
        """Whether the C++ layer's MLA form computes forward(): q_a and kv_a plain (no bias, quantization or
        adapter), one norm eps."""
        plain = [self.kv_a_proj_with_mqa] + ([] if self.q_lora_rank is None else [self.q_a_proj])
        return all(p.bias is None and p.weight_scale is None and p.lora is None for p in plain) and (
            self.q_lora_rank is None or self.q_a_layernorm.eps == self.kv_a_layernorm.eps)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, metadata: StepMetadata) -> torch.Tensor:
        """Decode rows over the latent cache → [tokens, heads * v_dim]."""
        query = torch.cat((self._absorb(q_nope), q_pe), dim=-1)  # [tokens, heads, lora + rope]
        out = self.attn.attend(query, metadata).view(-1, self.num_heads, self.kv_lora_rank + self.rope_dim)
        return self._values(out[..., :self.kv_lora_rank])

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                  metadata: AttentionMetadata) -> torch.Tensor:
        """The prefill chunks (sequences num_decodes onward; rows from the first chunk's) → [rows, heads * v_dim]."""
        key_cache = self.attn.kv_cache[0]
        first = metadata.query_start_loc[metadata.num_decodes]
        outputs = []
        for i in range(metadata.num_decodes, len(metadata.seq_lens)):
            start, end = metadata.query_start_loc[i] - first, metadata.query_start_loc[i + 1] - first
            seq_len = metadata.seq_lens[i]
            context = latent[start:end, 0] if end - start == seq_len else \
                context_of(key_cache, metadata.block_tables[i], seq_len)[0, 0]
            c_kv, k_pe = context.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            k_nope, value = self.kv_b_proj(c_kv).view(seq_len, self.num_heads, -1).split(
                [self.nope_dim, self.v_dim], dim=-1)
            key = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
            query = torch.cat((q_nope[start:end], q_pe[start:end]), dim=-1)
            out = prefill_chunk(query, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
                                self.attn.scale)
            outputs.append(out.reshape(end - start, -1))
        return torch.cat(outputs)

    def _absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, nope] → [tokens, heads, lora]: each head's query through its W_UK."""
        w_uk, _ = self._absorbed_weights
        compute = w_uk.dtype
        return torch.bmm(q_nope.transpose(0, 1).to(compute), w_uk).transpose(0, 1).to(q_nope.dtype)

    def _values(self, latent_out: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, lora] → [tokens, heads * v_dim]: each head's attended latent through its W_UV."""
        _, w_uv_t = self._absorbed_weights
        out = torch.bmm(latent_out.transpose(0, 1).to(w_uv_t.dtype), w_uv_t)
        return out.transpose(0, 1).reshape(latent_out.shape[0], -1).to(latent_out.dtype)

    @functools.cached_property
    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, lora], W_UV^T [heads, lora, v]) from the loaded kv_b_proj, in the matmul dtype."""
        weight = dequantized_weight(self.kv_b_proj)
        compute = matmul_dtype(self.kv_a_layernorm.weight.dtype, weight.device)
        per_head = weight.to(compute).view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = per_head.split([self.nope_dim, self.v_dim], dim=1)
        return w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()


def _decodes_of(metadata: AttentionMetadata) -> AttentionMetadata:
    """The step's metadata cut to its decode sequences (they come first)."""
    n = metadata.num_decodes
    device_starts, device_lens = metadata.device_query_start_loc, metadata.device_seq_lens
    return AttentionMetadata(metadata.slot_mapping[:metadata.query_start_loc[n]], metadata.block_tables[:n],
                             metadata.query_start_loc[:n + 1], metadata.seq_lens[:n], n,
                             None if device_starts is None else device_starts[:n + 1],
                             None if device_lens is None else device_lens[:n])


def _softmax_scale(config: PretrainedConfig, qk_dim: int) -> float:
    """1/sqrt(qk_dim), times YaRN's temperature squared when the rope scaling names mscale_all_dim (DeepSeek)."""
    rope = rope_parameters_of(config)
    mscale_all_dim = rope.get("mscale_all_dim") if rope_type_of(rope) != "default" else None
    mscale = yarn_mscale(rope["factor"], mscale_all_dim) if mscale_all_dim else 1.0
    return qk_dim**-0.5 * mscale * mscale


def _per_head_pairs(stacked: torch.Tensor) -> torch.Tensor:
    """Each head's matrix of [heads, N, K] as kernels.cpu_gemv.pair_weight lays it out, stacked."""
    return torch.stack([cpu_gemv.pair_weight(matrix) for matrix in stacked])


def _evens_first(x: torch.Tensor) -> torch.Tensor:
    """Adjacent-pair layout → rotate-half layout: dims 0, 2, 4, ... then 1, 3, 5, ..."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
