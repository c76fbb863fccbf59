"""Phi-3: the llama decoder; its checkpoint stores qkv_proj and gate_up_proj fused, which the merged linears
split on load, and its rotary may cover only part of each head (partial_rotary_factor)."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Layers as llama's; ColumnParallelLinear.weight_loader takes the fused tensors whole (shard_id None)."""
