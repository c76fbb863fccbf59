"""A stage's decoder layers, of every family they describe, for a step of decodes or short chunks in C++
(kernels/csrc/decoder_layer.h).

At batch-1 decode the weights stream in ~3 ms per token on this project's benchmark model, while the ~50 tensor
ops per layer that norm, rotate, cache, attend and gate cost several more in dispatch alone. The kernel runs the
layer's ops in order with the same roundings to the model dtype (its twin is the model's own op-by-op path,
tests/test_cpu_decoder_layer.py), with the GEMV kernel's products. Past the rows those products pay at, torch's GEMMs
run them and the kernel does the rest between them, four calls per layer (kernels/cpu_greedy_decode.py runs whole
steps of the model on top of these layers).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import cpu_extension, cpu_gemv


NORM_KINDS = {"rms": 0, "gemma": 1, "layer": 2}  # layer_ops.h's NormKind
ACTIVATIONS = {"silu_glu": 0, "gelu_tanh_glu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}  # and its Activation


@dataclass(frozen=True, kw_only=True)
class DecoderLayerWeights:
    """One layer's parameters (biases None where absent) and shape, and the form of its family's layer
    (decoder_layer.h's DecoderLayer: llama's by default); tensors, so a reloaded weight is followed.

    A projection may be int8 with a float32 scale per output row or group (weight-only quantization): its *_scale.
    A bf16 projection may come with its kernels.cpu_gemv.pair_weight copy (*_pairs), which its products then read.
    Every norm is of norm_kind ("rms", Gemma's "gemma" (1 + w), or "layer": LayerNorm with its *_bias) with eps:
    input_norm before attention, post_norm before the MLP, and where given attn_out_norm and mlp_out_norm on the
    attention's and the MLP's outputs (Gemma 2). q_norm and k_norm: an RMSNorm weight [head_dim] each q and k head
    goes through before rotary (Qwen3). gate_up: [gate | up] for a gated activation ("silu_glu", "gelu_tanh_glu"),
    else the one up product ("gelu", "gelu_tanh", "relu"). cos and sin: float32 [max_position, rotary_dim] of the
    leading dims that rotate, or None (learned positions). parallel_residual: GPT-NeoX's x + attn(ln1 x) + mlp(ln2 x);
    qkv_per_head: qkv's rows hold each head's q, k and v together; scale_q_first: q scaled and rounded before its
    scores (OPT); soft_cap: the attention scores' tanh cap (0: none).

    A mixture of experts (router [experts, hidden] given) replaces the dense MLP: each token's top_k experts by
    softmax score (renormalized where set, times routed_scaling), each a SwiGLU MLP of experts_gate_up [experts,
    2 * inter, hidden] and experts_down [experts, hidden, inter]; gate_up and down then are a shared expert's,
    weighted by sigmoid(x shared_gate^T) (Qwen-MoE), or None."""

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
    shared_gate: torch.Tensor | None = None
    top_k: int = 0
    renormalize: bool = False
    routed_scaling: float = 1.0

    @property
    def intermediate(self) -> int:
        return 0 if self.down is None else self.down.shape[1]

    def max_rows(self) -> int:
        """The most tokens of a step whose products the kernels run for these projections (max_rows)."""
        weights, pairs = [], []
        for (weight, _), paired in zip(self._projections(), self._pairs()):
            if weight is not None:
                weights.append(weight)
                pairs.append(paired)
        if self.router is not None:
            weights += [self.experts_gate_up[0], self.experts_down[0]]
        return max_rows(self.input_norm.dtype, weights, pairs)

    def args(self) -> tuple[list[int], list[int], list[float]]:
        """The layer as the kernels' module takes it (module.cpp's LayerArgs: pointers, dims, floats)."""
        tensors = (self.input_norm, self.qkv, self.qkv_bias, self.o, self.o_bias, self.post_norm, self.gate_up,
                   self.down, self.cos, self.sin, self.qkv_scale, self.o_scale, self.gate_up_scale, self.down_scale,
                   *self._pairs(), self.q_norm, self.k_norm, self.input_norm_bias, self.post_norm_bias,
                   self.attn_out_norm, self.mlp_out_norm, self.gate_up_bias, self.down_bias, self.router,
                   self.experts_gate_up, self.experts_down, self.shared_gate)
        groups = [0 if scale is None else _scale_group(weight, scale) for weight, scale in self._projections()]
        experts = [0, 0, 0, 0] if self.router is None else \
            [self.router.shape[0], self.top_k, self.experts_down.shape[2], int(self.renormalize)]
        dims = [self.qkv.shape[1], self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate,
                self.sliding_window or 0, *groups, 0 if self.cos is None else self.cos.shape[1],
                NORM_KINDS[self.norm_kind], ACTIVATIONS[self.activation], int(self.parallel_residual),
                int(self.qkv_per_head), int(self.scale_q_first), *experts]
        return [_pointer(t) for t in tensors], dims, [self.eps, self.scale, self.soft_cap, self.routed_scaling]

    def check(self, dtype: torch.dtype) -> None:
        """Each projection of the hidden states' dtype, or int8 with its float32 scales (per row or group); norms,
        biases and rotary tables that fit the shape."""
        for weight, scale in self._projections():
            if weight is None:
                continue
            int8 = weight.dtype == torch.int8 and scale is not None and scale.dtype == torch.float32 \
                and scale.is_contiguous() and _scale_group(weight, scale) is not None
            if not (int8 or (weight.dtype == dtype and scale is None)):
                raise TypeError("a projection's weight must be of the hidden states' dtype, or int8 with float32 "
                                "scales per row [N] or per group of a multiple of 8 columns [N, K / group]")
        hidden, width = self.qkv.shape[1], self.intermediate * (2 if self.activation.endswith("_glu") else 1)
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        shapes = {"input_norm": hidden, "post_norm": hidden, "input_norm_bias": hidden, "post_norm_bias": hidden,
                  "attn_out_norm": hidden, "mlp_out_norm": hidden, "q_norm": self.head_dim, "k_norm": self.head_dim,
                  "qkv_bias": qkv_rows, "o_bias": hidden, "gate_up_bias": width, "down_bias": hidden}
        for name, size in shapes.items():
            tensor = getattr(self, name)
            if tensor is not None and not (tensor.dtype == dtype and tensor.shape == (size,) and tensor.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous [{size}] tensor of the hidden states' dtype")
        if self.qkv.shape[0] != qkv_rows or self.o.shape != (hidden, self.num_heads * self.head_dim) or (
                (self.gate_up is None) != (self.down is None)) or (
                self.gate_up is not None and self.gate_up.shape[0] != width):
            raise ValueError("the projections do not fit the layer's heads and activation")
        self._check_experts(dtype, hidden)
        if self.qkv_per_head and self.num_heads != self.num_kv_heads:
            raise ValueError("q, k and v per head need as many kv heads as heads")
        if self.cos is not None and not (self.cos.dtype == self.sin.dtype == torch.float32 and self.cos.is_contiguous()
                                         and self.sin.is_contiguous() and self.cos.shape == self.sin.shape
                                         and self.cos.shape[1] <= self.head_dim and self.cos.shape[1] % 2 == 0):
            raise ValueError("cos and sin must be contiguous float32 [max_position, rotary_dim <= head_dim] tables")
        for (weight, _), pairs in zip(self._projections(), self._pairs()):
            if pairs is not None and weight is not None and not (weight.dtype == dtype == torch.bfloat16 and cpu_gemv.pairs_serve(weight)
                                          and cpu_gemv.fits_pairs(weight, pairs)):
                raise ValueError("a projection's pairs must be kernels.cpu_gemv.pair_weight of its bf16 weight, on a "
                                 "CPU with AVX-512 BF16")

    def _check_experts(self, dtype: torch.dtype, hidden: int) -> None:
        """A mixture of experts of the hidden states' dtype with a SwiGLU per expert; a dense MLP only as its
        shared expert; or neither (a dense MLP)."""
        if self.router is None:
            if self.gate_up is None or self.shared_gate is not None:
                raise ValueError("a layer without experts needs its dense MLP and no shared expert gate")
            return
        experts = self.router.shape[0]
        tensors = (self.router, self.experts_gate_up, self.experts_down)
        if not all(t is not None and t.dtype == dtype and t.is_contiguous() for t in tensors) or \
                self.router.shape != (experts, hidden) or self.experts_gate_up.dim() != 3 or \
                self.experts_down.shape != (experts, hidden, self.experts_gate_up.shape[1] // 2) or \
                self.experts_gate_up.shape != (experts, 2 * self.experts_down.shape[2], hidden):
            raise ValueError("experts need a router [experts, hidden], gate_up [experts, 2 inter, hidden] and down "
                             "[experts, hidden, inter] of the hidden states' dtype")
        if not 0 < self.top_k <= experts or self.activation != "silu_glu":
            raise ValueError("experts take top_k of 1 up to their count, each a SwiGLU MLP")
        if (self.shared_gate is None) != (self.gate_up is None) or (
                self.shared_gate is not None and not (self.shared_gate.dtype == dtype and self.shared_gate.shape
                                                      == (1, hidden) and self.shared_gate.is_contiguous())):
            raise ValueError("a shared expert needs its gate [1, hidden] of the hidden states' dtype, and its MLP")

    def _projections(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        return ((self.qkv, self.qkv_scale), (self.o, self.o_scale), (self.gate_up, self.gate_up_scale),
                (self.down, self.down_scale))

    def _pairs(self) -> tuple[torch.Tensor | None, ...]:
        return self.qkv_pairs, self.o_pairs, self.gate_up_pairs, self.down_pairs


def _pointer(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _scale_group(weight: torch.Tensor, scale: torch.Tensor) -> int | None:
    """0 for a scale per row, the group size for scales per group the kernel takes, None for other scales."""
    if scale.shape == weight.shape[:1]:
        return 0
    if scale.dim() == 2 and scale.shape[0] == weight.shape[0] and cpu_gemv.takes_groups(weight, scale):
        return weight.shape[1] // scale.shape[1]
    return None


def takes_projection(weight: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                     g_idx: torch.Tensor | None) -> bool:
    """Whether the one-call layer reads this projection: unquantized, or symmetric int8 with scales per row or per
    group (GGUF's Q8_0)."""
    return scale is None or (weight.dtype == torch.int8 and zero is None and g_idx is None
                             and _scale_group(weight, scale) is not None)


# A step with a prompt chunk of more than LONG_RUN_ROWS tokens that reaches position LONG_RUN_CONTEXT goes to the op
# path: SDPA's GEMMs attend to such a run faster than the kernel's rows, whose scores grow with rows x context
# (bf16, 8 heads over 4 KV heads of 64, 2-core AVX-512 BF16 EPYC: a whole prompt of 1024 tokens 15.9 ms against
# 17.4, 1536 37 against 55; 256 rows at 2048 the same), while shorter ones are faster in the kernel (400 tokens
# 1.7 against 3.2 ms, 768 7.7 against 9.4; float32 1.9 against 3.0 and 5.5 against 8.6) and the layer's other ops
# with it (a throughput run whose prompts are 16-400 tokens: 0.90x the time with them in the kernel). Measured on a
# Zen 4 against SDPA with a materialized mask; SDPA now takes the causal mask as its lower-right bias and skips the
# blocks above the diagonal (2x at 2048 tokens), and the kernel attends a long run in pieces whose scores fit half
# an L2: on a Zen 5 the kernel is then about 2x faster at every length measured (bf16: 1024 tokens 4.4 against 9.5
# ms, 2048 15.6 against 30), but against SDPA it stood ~2.3x worse on the Zen 4 this was tuned on, where the two would
# now be about even at 768-1024. Not re-tuned without a Zen 4 to measure on.
LONG_RUN_ROWS, LONG_RUN_CONTEXT = 16, 768


def max_rows(dtype: torch.dtype, weights: Sequence[torch.Tensor] = (),
             pairs: Sequence[torch.Tensor | None] = ()) -> int:
    """The most tokens of a step whose products the layer runs in the kernels (the least of cpu_gemv's limits for
    its projection weights, if given, with their pairs copies where given); past them torch's
    GEMMs are faster, and the layer takes them between its calls (decoder_layers_with_products: in-process decode
    of the benchmark model on a 2-core AVX-512 BF16 EPYC, 10.5 ms per step at 16 requests against 12.3 with the
    kernels' products and 14.0 on the op path; 14.6 against 18.3 on the op path at 32, 25.0 against 29.1 at 64)."""
    return min((cpu_gemv.max_rows(dtype, weight, paired) for weight, paired in itertools.zip_longest(weights, pairs)),
               default=cpu_gemv.max_rows(dtype))


@dataclass(frozen=True)
class DecodeStep:
    """What every layer of one step reads, one row per token: int64 tensors."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # the block table of each token's sequence
    seq_lens: torch.Tensor  # position + 1: the slots each token attends to
    # Few enough tokens for the kernels' products (max_rows): decoder_layers(); else decoder_layers_with_products().
    kernel_products: bool


def decode_step(x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                query_start_loc: list[int], max_product_rows: int | None = None) -> DecodeStep | None:
    """The step's inputs for the C++ layer when it takes this step, else None: on the CPU, float32 or bfloat16, at
    inference, kernel built, and no sequence of more than LONG_RUN_ROWS tokens reaching position LONG_RUN_CONTEXT.
    Up to max_product_rows tokens (default: max_rows(x.dtype); a model gives its weights' limit) its products run in
    the kernels too.

    Each token is its own attention row over its sequence's blocks, seeing the first position + 1 slots: causal
    attention, so decodes, speculative verification (1 + k tokens of a sequence) and short prompt chunks all fit.
    """
    tokens = x.shape[0]
    if not (tokens > 0 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and not torch.is_grad_enabled() and cpu_extension.ready() is not None):
        return None
    positions = positions.long().contiguous()
    tables = block_tables.long()
    if tokens != len(query_start_loc) - 1:  # some sequence has several tokens: repeat its table row for each
        starts = torch.tensor(query_start_loc)
        counts = starts.diff()
        long_runs = counts > LONG_RUN_ROWS
        if bool(long_runs.any()) and int(positions[starts[1:][long_runs] - 1].max()) >= LONG_RUN_CONTEXT:
            return None
        tables = tables.repeat_interleave(counts, dim=0)
    return DecodeStep(positions, slot_mapping.long().contiguous(), tables.contiguous(), positions + 1,
                      tokens <= (max_rows(x.dtype) if max_product_rows is None else max_product_rows))


Product = Callable[[torch.Tensor], torch.Tensor]


class PreparedLayers:
    """A stage's layers, their (key, value) caches and the final norm (of the layers' norm kind, its bias where a
    LayerNorm has one) as the kernel takes them, checked and turned into pointer lists once rather than every step
    (the weights stay where loading put them; a model makes these again when its caches are bound anew)."""

    def __init__(self, layers: Sequence[DecoderLayerWeights], caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype, final_norm: torch.Tensor | None = None, final_eps: float = 0.0,
                 final_norm_bias: torch.Tensor | None = None) -> None:
        self.module = _checked(layers, caches, dtype, final_norm, final_norm_bias)
        self.layers, self.caches, self.dtype = list(layers), list(caches), dtype
        self.layer_args = [w.args() for w in layers]
        self.block_size = caches[0][0].shape[2]
        self.final_norm = final_norm
        # module.cpp's StageArgs
        self.stage_args = ([a[0] for a in self.layer_args], [a[1] for a in self.layer_args],
                           [a[2] for a in self.layer_args], [k.data_ptr() for k, _ in caches],
                           [v.data_ptr() for _, v in caches], _pointer(final_norm), _pointer(final_norm_bias),
                           final_eps)

    def check(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype:
            raise TypeError(f"the layers were prepared for {self.dtype}, not {x.dtype}")

    def serves(self, caches: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> bool:
        """Whether these are still the caches (and dtype) it was prepared for."""
        return dtype == self.dtype and len(caches) == len(self.caches) and all(
            a is b for a, b in zip(caches, self.caches))


def decoder_layers(prepared: PreparedLayers, x: torch.Tensor, residual: torch.Tensor | None, step: DecodeStep
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepared layers in order in one call: (out, residual), whose sum is the last layer's output (llama's
    layers return them so); with a final norm, (its norm of that sum, the sum). Saves the per-layer Python and
    dispatch of a step (~0.3 ms per token of batch-1 decode on the benchmark model)."""
    prepared.check(x)
    x = x.contiguous()  # kept in locals: the kernel gets raw pointers, which must outlive the call
    residual = None if residual is None else residual.contiguous()
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    prepared.module.decoder_layers(
        x.dtype == torch.bfloat16, prepared.stage_args, x.data_ptr(), _pointer(residual), out.data_ptr(),
        residual_out.data_ptr(), step.positions.data_ptr(), step.slot_mapping.data_ptr(), prepared.block_size,
        step.block_tables.data_ptr(), step.block_tables.shape[1], step.seq_lens.data_ptr(), x.shape[0])
    return out, residual_out


def decoder_layers_with_products(prepared: PreparedLayers,
                                 products: Sequence[tuple[Product, Product, Product, Product | None]], x: torch.Tensor,
                                 residual: torch.Tensor | None, step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
    """decoder_layers() for a step of more tokens than the kernels' products take: each layer's (qkv, o, gate_up,
    down) products are the given functions (the model's linear layers: torch's GEMMs; a mixture of experts gives its
    whole MLP as gate_up and None as down), everything between them the kernel's layer phases, in four calls per
    layer instead of the op path's ~50 tensor ops."""
    prepared.check(x)
    module = prepared.module
    bf16, tokens = x.dtype == torch.bfloat16, x.shape[0]
    rows = step.positions.data_ptr(), step.slot_mapping.data_ptr()
    tables = step.block_tables.data_ptr(), step.block_tables.shape[1], step.seq_lens.data_ptr()
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    residual_out, normed = torch.empty_like(x), torch.empty_like(x)
    key_caches, value_caches = prepared.stage_args[3:5]
    for i, (weights, (qkv_proj, o_proj, gate_up_proj, down_proj), layer) in enumerate(
            zip(prepared.layers, products, prepared.layer_args, strict=True)):
        before = residual_out.data_ptr() if i else _pointer(residual)
        module.before_attention(bf16, layer, x.data_ptr(), before, residual_out.data_ptr(), normed.data_ptr(), tokens)
        qkv = qkv_proj(normed).contiguous()
        attn = torch.empty(tokens, weights.num_heads * weights.head_dim, dtype=x.dtype)
        module.attend(bf16, layer, qkv.data_ptr(), *rows, key_caches[i], value_caches[i], prepared.block_size,
                      *tables, attn.data_ptr(), tokens)
        o = o_proj(attn).contiguous()
        module.after_attention(bf16, layer, o.data_ptr(), residual_out.data_ptr(), normed.data_ptr(), tokens)
        if down_proj is None:  # a mixture of experts: the product is the layer's whole MLP
            x = gate_up_proj(normed).contiguous()
        else:
            h = gate_up_proj(normed).contiguous()
            act = torch.empty(tokens, weights.intermediate, dtype=x.dtype)
            module.activate(bf16, layer, h.data_ptr(), act.data_ptr(), tokens)
            x = down_proj(act).contiguous()
        module.after_mlp(bf16, layer, x.data_ptr(), o.data_ptr(), tokens)
    if prepared.final_norm is None:
        return x, residual_out
    module.final_norm(bf16, prepared.stage_args, x.data_ptr(), residual_out.data_ptr(), residual_out.data_ptr(),
                      normed.data_ptr(), tokens)
    return normed, residual_out


def _checked(layers: Sequence[DecoderLayerWeights], caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             dtype: torch.dtype, final_norm: torch.Tensor | None, final_norm_bias: torch.Tensor | None
             ) -> ModuleType:
    """The kernels' module, once the layers (of one norm kind), caches and final norm are found fit for hidden
    states of `dtype`."""
    module = cpu_extension.load()
    if module is None:
        raise RuntimeError("the C++ CPU kernels could not be built")
    if not layers:
        raise ValueError("no layers to run")
    for weights, (key_cache, value_cache) in zip(layers, caches, strict=True):
        if key_cache.dtype != dtype or value_cache.dtype != dtype or weights.input_norm.dtype != dtype:
            raise TypeError("the caches and norms must share the hidden states' dtype")
        weights.check(dtype)
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("the caches must be contiguous")
    if len({weights.norm_kind for weights in layers}) != 1:
        raise ValueError("a stage's layers share one norm kind")
    if any(t is not None and t.dtype != dtype for t in (final_norm, final_norm_bias)):
        raise TypeError("the final norm must share the hidden states' dtype")
    return module
