"""A decoder layer as the C++ layer reads it (kernels/csrc/decoder_layer.h's DecoderLayer): its parameters, shape
and its family's form, checked and turned into the pointer, dims and floats lists the kernels' module takes; and the
rows of a step whose products the kernels run for its weights."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import (
    cpu_deepseek_weights,
    cpu_fp8_pairs,
    cpu_gemv,
    cpu_int4,
    cpu_layer_checks,
    cpu_projections,
)
from kernels.quantized_matmul import input_size_of

NORM_KINDS = {"rms": 0, "gemma": 1, "layer": 2}  # layer_ops.h's NormKind
# One expert's multiply-adds over its mean share of a step's rows past which torch's GEMMs (oneDNN's: AMX where the
# CPU has it) beat the kernels' products from the paired copies, torch's per-expert Python included
# (benchmarks/moe_fused_layer.py --cpu-time: Mixtral 30m's experts cross near 16 rows each, Qwen-MoE 30m's quarter
# width ones stay faster in the kernels up to 64 rows).
EXPERT_MAX_PRODUCTS = 40_000_000
ACTIVATIONS = {"silu_glu": 0, "gelu_tanh_glu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}  # and its Activation


@dataclass(frozen=True)
class AdapterSlots:
    """A projection's LoRA slots as workers/lora/slots.py keeps them: a [slots, width, K] and bt [slots, width, N] (its
    b transposed) of the adapters' compute dtype (float32 or bf16), used [slots] bool; offsets: a merged projection's
    parts (int64 [parts + 1] output rows; part p's outputs read only its width / parts rows of bt), None for one
    part."""

    a: torch.Tensor
    bt: torch.Tensor
    used: torch.Tensor
    offsets: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class DecoderLayerWeights:
    """One layer's parameters (biases None where absent) and shape, and the form of its family's layer
    (decoder_layer.h's DecoderLayer: llama's by default); tensors, so a reloaded weight is followed.

    A projection may be int8 or fp8 e4m3 with a float32 scale per output row or group (weight-only quantization):
    its *_scale; or 4-bit with its *_scale and *_zero (None: 8), and *_pairs its kernels.cpu_int4.pair_int4 copy.
    A bf16 projection may come with its kernels.cpu_gemv.pair_weight copy (*_pairs), which its products then read.
    Every norm is of norm_kind ("rms", Gemma's "gemma" (1 + w), or "layer": LayerNorm with its *_bias) with eps:
    input_norm before attention, post_norm before the MLP, and where given attn_out_norm and mlp_out_norm on the
    attention's and the MLP's outputs (Gemma 2). q_norm and k_norm: the weight [head_dim] of the norm (of norm_kind)
    each q and k head goes through before rotary (Qwen3, Gemma 3). gate_up: [gate | up] for a gated activation
    ("silu_glu", "gelu_tanh_glu"), else the one up product ("gelu", "gelu_tanh", "relu"). cos and sin: float32
    [max_position, rotary_dim] of the leading dims that rotate, or None (learned positions). parallel_residual:
    GPT-NeoX's x + attn(ln1 x) + mlp(ln2 x); qkv_per_head: qkv's rows hold each head's q, k and v together;
    scale_q_first: q scaled and rounded before its scores (OPT); soft_cap: the attention scores' tanh cap (0: none).

    A mixture of experts (router [experts, hidden] given) replaces the dense MLP: each token's top_k experts by
    softmax score (renormalized where set, times routed_scaling), each a SwiGLU MLP of experts_gate_up [experts,
    2 * inter, hidden] and experts_down [experts, hidden, inter]; gate_up and down then are a shared expert's,
    weighted by sigmoid(x shared_gate^T) (Qwen-MoE), or None; experts_*_pairs: the experts' pair_weight copies,
    [experts, *pairs_shape of one expert's weight] (bf16), which their products then read. *_lora: a projection's
    adapter slots, whose deltas the rows of a step with an adapter get.

    Multi-head latent attention (DeepSeek; mla_kv_a given): qkv is the q projection [heads * (nope + rope), hidden]
    (V3: q_b_proj [.., q_lora] over mla_q_a's rows [q_lora, hidden] normed by mla_q_a_norm), mla_kv_a [lora + rope,
    hidden] the latent's, normed by mla_kv_norm [lora]; mla_w_uk_t [heads, lora, nope] and mla_w_uv [heads, v, lora]
    (kv_b_proj's halves); o [hidden, heads * v]; head_dim lora + rope over one KV head; RMSNorms of mla_eps;
    mla_q_a_pairs, mla_kv_a_pairs: their bf16 pair_weight copies, mla_w_uk_t_pairs, mla_w_uv_pairs each head's,
    stacked [heads, *pairs_shape]; or None.

    DeepSeek's routing (grouped_router, the router's float32 copy, given): float32 logits, softmax or sigmoid scores
    (sigmoid_scores), top_k within the topk_groups best of expert_groups groups, chosen by score + correction_bias
    (float32 [experts], V3) where given; gate_up and down then are the shared experts' MLP, added ungated."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden] gated, else [intermediate, hidden]
    down: torch.Tensor | None  # [hidden, intermediate]
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    eps: float
    scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    qkv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    qkv_pairs: torch.Tensor | None = None
    o_pairs: torch.Tensor | None = None
    gate_up_pairs: torch.Tensor | None = None
    down_pairs: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_kind: str = "rms"
    input_norm_bias: torch.Tensor | None = None
    post_norm_bias: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    activation: str = "silu_glu"
    parallel_residual: bool = False
    qkv_per_head: bool = False
    scale_q_first: bool = False
    soft_cap: float = 0.0
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None
    experts_gate_up_pairs: torch.Tensor | None = None
    experts_down_pairs: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    top_k: int = 0
    renormalize: bool = False
    routed_scaling: float = 1.0
    qkv_lora: AdapterSlots | None = None
    o_lora: AdapterSlots | None = None
    gate_up_lora: AdapterSlots | None = None
    down_lora: AdapterSlots | None = None
    mla_q_a: torch.Tensor | None = None
    mla_kv_a: torch.Tensor | None = None
    mla_q_a_norm: torch.Tensor | None = None
    mla_kv_norm: torch.Tensor | None = None
    mla_w_uk_t: torch.Tensor | None = None
    mla_w_uv: torch.Tensor | None = None
    mla_q_a_pairs: torch.Tensor | None = None
    mla_kv_a_pairs: torch.Tensor | None = None
    mla_w_uk_t_pairs: torch.Tensor | None = None
    mla_w_uv_pairs: torch.Tensor | None = None
    mla_eps: float = 0.0
    grouped_router: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None
    expert_groups: int = 0
    topk_groups: int = 0
    sigmoid_scores: bool = False
    qkv_zero: torch.Tensor | None = None
    o_zero: torch.Tensor | None = None
    gate_up_zero: torch.Tensor | None = None
    down_zero: torch.Tensor | None = None

    @property
    def mla_dims(self) -> list[int]:
        """MLA's kv_lora_rank, q_lora_rank, nope, rope and v head dims (all 0 without MLA)."""
        if self.mla_kv_a is None:
            return [0] * 5
        lora = self.mla_kv_norm.shape[0]
        return [lora, 0 if self.mla_q_a is None else self.mla_q_a.shape[0], self.mla_w_uk_t.shape[2],
                self.head_dim - lora, self.mla_w_uv.shape[1]]

    @property
    def attn_width(self) -> int:
        """The attention's output per token, o's input."""
        return self.num_heads * (self.mla_dims[4] if self.mla_kv_a is not None else self.head_dim)

    @property
    def intermediate(self) -> int:
        return 0 if self.down is None else input_size_of(self.down)

    def max_rows(self) -> int:
        """The most tokens of a step whose products the kernels run for these projections (max_rows)."""
        weights, pairs = [], []
        for (weight, _), paired in zip(self.projections(), self._pairs()):
            if weight is not None:
                weights.append(weight)
                pairs.append(paired)
        for weight, paired in self._mla_products():
            weights.append(weight)
            pairs.append(paired)
        if self.router is None:
            return cpu_projections.max_rows(self.input_norm.dtype, weights, pairs)
        weights += [self.experts_gate_up[0], self.experts_down[0]]
        pairs += [self.experts_gate_up_pairs, self.experts_down_pairs]
        limit = cpu_projections.max_rows(self.input_norm.dtype, weights, pairs)
        if self.experts_gate_up_pairs is None:
            return limit
        # Each expert takes top_k / experts of a step's rows on average: its products stay within EXPERT_MAX_PRODUCTS.
        per_row = self.experts_gate_up[0].numel() + self.experts_down[0].numel()
        return max(1, min(limit, EXPERT_MAX_PRODUCTS * self.router.shape[0] // (self.top_k * per_row)))

    def args(self) -> tuple[list[int], list[int], list[float]]:
        """The layer as the kernels' module takes it (module.cpp's LayerArgs: pointers, dims, floats)."""
        tensors = (self.input_norm, self.qkv, self.qkv_bias, self.o, self.o_bias, self.post_norm, self.gate_up,
                   self.down, self.cos, self.sin, self.qkv_scale, self.o_scale, self.gate_up_scale, self.down_scale,
                   *self._pairs(), self.q_norm, self.k_norm, self.input_norm_bias, self.post_norm_bias,
                   self.attn_out_norm, self.mlp_out_norm, self.gate_up_bias, self.down_bias, self.router,
                   self.experts_gate_up, self.experts_down, self.shared_gate,
                   *(t for slots in self.loras() for t in ((None,) * 3 if slots is None else
                                                             (slots.a, slots.bt, slots.used))),
                   self.mla_q_a, self.mla_kv_a, self.mla_q_a_norm, self.mla_kv_norm, self.mla_w_uk_t, self.mla_w_uv,
                   self.grouped_router, self.correction_bias, self.experts_gate_up_pairs,
                   self.experts_down_pairs, self.mla_q_a_pairs, self.mla_kv_a_pairs, self.mla_w_uk_t_pairs,
                   self.mla_w_uv_pairs, *(None if slots is None else slots.offsets for slots in self.loras()),
                   *self.zeros())
        groups = [0 if scale is None else cpu_projections.scale_group(weight, scale)
                  for weight, scale in self.projections()]
        experts = [0, 0, 0, 0] if self.router is None else \
            [self.router.shape[0], self.top_k, self.experts_down.shape[2], int(self.renormalize)]
        dims = [self.input_norm.shape[0], self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate,
                self.sliding_window or 0, *groups, 0 if self.cos is None else self.cos.shape[1],
                NORM_KINDS[self.norm_kind], ACTIVATIONS[self.activation], int(self.parallel_residual),
                int(self.qkv_per_head), int(self.scale_q_first), *experts,
                *(0 if slots is None else slots.a.shape[1] for slots in self.loras()),
                int(any(slots is not None and slots.a.dtype == torch.bfloat16 for slots in self.loras())),
                *(int(weight is not None and weight.dtype == torch.float8_e4m3fn) for weight, _ in self.projections()),
                *self.mla_dims, self.expert_groups, self.topk_groups, int(self.sigmoid_scores),
                *(1 if slots is None or slots.offsets is None else slots.offsets.numel() - 1
                  for slots in self.loras()),
                *(int(weight is not None and weight.dtype == torch.uint8) for weight, _ in self.projections())]
        return [pointer(t) for t in tensors], dims, [self.eps, self.scale, self.soft_cap, self.routed_scaling,
                                                     self.mla_eps]

    def check(self, dtype: torch.dtype) -> None:
        """Each projection of the hidden states' dtype, or int8 or fp8 with its float32 scales (per row or group);
        norms, biases and rotary tables that fit the shape."""
        for (weight, scale), zero, pairs in zip(self.projections(), self.zeros(), self._pairs()):
            if weight is None:
                continue
            if weight.dtype == torch.uint8:
                cpu_int4.check(weight, scale, zero, pairs, dtype)
                continue
            if zero is not None:
                raise ValueError("zero points: only a 4-bit projection takes them")
            scaled = weight.dtype in cpu_gemv.SCALED_DTYPES and scale is not None and scale.dtype == torch.float32 \
                and scale.is_contiguous() and cpu_projections.scale_group(weight, scale) is not None
            if not (scaled or (weight.dtype == dtype and scale is None)):
                raise TypeError("a projection's weight must be of the hidden states' dtype, or int8 or fp8 e4m3 with "
                                "float32 scales per row [N] or per group of a multiple of 8 columns [N, K / group]")
        hidden, width = self.input_norm.shape[0], self.intermediate * (2 if self.activation.endswith("_glu") else 1)
        qkv_rows, qkv_in = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, hidden
        if self.mla_kv_a is not None:
            qkv_rows, qkv_in = cpu_deepseek_weights.check_mla(self, dtype, hidden)
        shapes = {"input_norm": hidden, "post_norm": hidden, "input_norm_bias": hidden, "post_norm_bias": hidden,
                  "attn_out_norm": hidden, "mlp_out_norm": hidden, "q_norm": self.head_dim, "k_norm": self.head_dim,
                  "qkv_bias": qkv_rows, "o_bias": hidden, "gate_up_bias": width, "down_bias": hidden}
        for name, size in shapes.items():
            tensor = getattr(self, name)
            if tensor is not None and not (tensor.dtype == dtype and tensor.shape == (size,)
                                           and tensor.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous [{size}] tensor of the hidden states' dtype")
        features = cpu_projections.features
        if features(self.qkv) != (qkv_rows, qkv_in) or features(self.o) != (hidden, self.attn_width) or (
                (self.gate_up is None) != (self.down is None)) or (
                self.gate_up is not None and self.gate_up.shape[0] != width):
            raise ValueError("the projections do not fit the layer's heads and activation")
        cpu_layer_checks.check_experts(self, dtype, hidden)
        cpu_layer_checks.check_loras(self)
        if self.qkv_per_head and self.num_heads != self.num_kv_heads:
            raise ValueError("q, k and v per head need as many kv heads as heads")
        if self.cos is not None and not (self.cos.dtype == self.sin.dtype == torch.float32 and self.cos.is_contiguous()
                                         and self.sin.is_contiguous() and self.cos.shape == self.sin.shape
                                         and self.cos.shape[1] <= self.head_dim and self.cos.shape[1] % 2 == 0):
            raise ValueError("cos and sin must be contiguous float32 [max_position, rotary_dim <= head_dim] tables")
        for (weight, scale), pairs in [*zip(self.projections(), self._pairs()),
                                       *(((w, None), p) for w, p in self._mla_products())]:
            if pairs is not None and weight is not None and weight.dtype == torch.float8_e4m3fn:
                if not (dtype == torch.bfloat16 and cpu_fp8_pairs.pairs_serve(weight, scale)
                        and cpu_fp8_pairs.fits_pairs(weight, scale, pairs)):
                    raise ValueError("an fp8 projection's pairs must be kernels.cpu_fp8_pairs.pair_fp8 of its weight "
                                     "and scales in a bf16 layer, on a CPU with AVX-512 BF16 and VBMI")
                continue
            if pairs is not None and weight is not None and weight.dtype != torch.uint8 and not (
                    dtype == torch.bfloat16 and cpu_gemv.pairs_serve(weight, scale)
                    and cpu_gemv.fits_pairs(weight, pairs)):
                raise ValueError("a projection's pairs must be kernels.cpu_gemv.pair_weight of its bf16 weight (or "
                                 "int8 one with a scale per row) in a bf16 layer, on a CPU with AVX-512 BF16")

    def loras(self) -> tuple[AdapterSlots | None, ...]:
        return self.qkv_lora, self.o_lora, self.gate_up_lora, self.down_lora

    def projections(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        return ((self.qkv, self.qkv_scale), (self.o, self.o_scale), (self.gate_up, self.gate_up_scale),
                (self.down, self.down_scale))

    def zeros(self) -> tuple[torch.Tensor | None, ...]:
        return self.qkv_zero, self.o_zero, self.gate_up_zero, self.down_zero

    def _pairs(self) -> tuple[torch.Tensor | None, ...]:
        return self.qkv_pairs, self.o_pairs, self.gate_up_pairs, self.down_pairs

    def _mla_products(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """MLA's q_a (V3) and kv_a weights that are given, with their pairs copies."""
        return [(weight, pairs) for weight, pairs in ((self.mla_q_a, self.mla_q_a_pairs),
                                                      (self.mla_kv_a, self.mla_kv_a_pairs)) if weight is not None]


def pointer(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()
