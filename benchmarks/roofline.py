"""The GPU's two ceilings (device-to-device copy bandwidth, bf16 matrix rate on random data, both measured) and a
llama-shaped model's floors: the weight bytes a decode step reads, and the FLOPs and bytes of an offline workload of
N requests (input, output lengths fixed), for benchmarks/cuda_e2e.py."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

COPY_BYTES = 1 << 30
MATMUL_SIZE = 8192


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB, read + write, median of 20 after warm-up."""
    src = torch.randint(0, 255, (COPY_BYTES,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        if i >= 5:
            times.append(time.perf_counter() - start)
    return 2 * COPY_BYTES / sorted(times)[len(times) // 2]


def matmul_rate(device: str, size: int = MATMUL_SIZE) -> float:
    """FLOP/s of a bf16 size³ product on random data (never zeros: they run faster), the median of 10 after 3."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(13):
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * size ** 3 / sorted(times)[len(times) // 2]


@dataclass
class Shape:
    """What the floors read of a llama-style config (a mixture of experts in every layer: Mixtral, Qwen3-MoE)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_weights: int  # elements of one layer's MLP that a token reads: its router and top-k experts in a mixture
    vocab: int

    @classmethod
    def of(cls, model_dir: str) -> Shape:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model_dir)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        mlp = 3 * c.hidden_size * c.intermediate_size
        if getattr(c, "num_experts_per_tok", None):
            width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
            experts = getattr(c, "num_experts", None) or c.num_local_experts
            mlp = c.num_experts_per_tok * 3 * c.hidden_size * width + c.hidden_size * experts
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return cls(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, kv_heads, head_dim, mlp, c.vocab_size)

    @property
    def layer_weights(self) -> int:
        """Elements of one decoder layer's linear weights that a token reads."""
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + self.mlp_weights

    def weight_bytes(self, layer_bytes: int = 2) -> int:
        """Bytes of every linear layer a token reads (layer_bytes an element: 1 for int8) and the bf16 LM head (not
        the embedding table): what one decode step of one row reads."""
        return layer_bytes * self.layers * self.layer_weights + 2 * self.hidden * self.vocab

    def kv_bytes(self, tokens: int) -> int:
        """bf16 K and V of `tokens` positions over every layer."""
        return 2 * 2 * self.layers * self.kv_heads * self.head_dim * tokens

    def attention_flops(self, queries: int, keys: int) -> float:
        """Scores and values of `queries` rows over `keys` keys each (summed), every layer and head."""
        return 4.0 * self.layers * self.heads * self.head_dim * queries * keys


@dataclass
class WorkloadFloors:
    """Floors of N requests of `input_len` prompt tokens and `output_len` generated tokens, max_num_seqs at once:
    the prefill's FLOPs (products of every prompt token, causal attention, the LM head of its last token), and the
    decode's FLOPs and bytes (each step reads the weights once and the running requests' K/V)."""

    prefill_flops: float
    decode_flops: float
    decode_bytes: float

    @classmethod
    def of(cls, shape: Shape, requests: int, input_len: int, output_len: int, max_num_seqs: int) -> WorkloadFloors:
        product = 2.0 * shape.layers * shape.layer_weights
        head = 2.0 * shape.hidden * shape.vocab
        prefill = requests * (input_len * product + shape.attention_flops(1, input_len * (input_len + 1) // 2)
                              + head)
        decodes = requests * (output_len - 1)  # the first token is the prefill's
        contexts = requests * sum(input_len + t for t in range(1, output_len))  # keys each decode row reads
        steps = decodes / max_num_seqs  # at most max_num_seqs rows a step
        return cls(prefill, decodes * (product + head) + shape.attention_flops(1, contexts),
                   steps * shape.weight_bytes() + shape.kv_bytes(contexts))

    def prefill_s(self, flops_per_s: float) -> float:
        return self.prefill_flops / flops_per_s

    def decode_s(self, flops_per_s: float, bytes_per_s: float) -> float:
        return max(self.decode_flops / flops_per_s, self.decode_bytes / bytes_per_s)
