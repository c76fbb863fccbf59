"""A stage's llama-style decoder layers for a step of decodes or short chunks in C++ (kernels/csrc/decoder_layer.h).

At batch-1 decode the weights stream in ~3 ms per token on this project's benchmark model, while the ~50 tensor
ops per layer that norm, rotate, cache, attend and gate cost several more in dispatch alone. The kernel runs the
layer's ops in order with the same roundings to the model dtype (its twin is the model's own op-by-op path,
tests/test_cpu_decoder_layer.py), with the GEMV kernel's products. Past the rows those products pay at, torch's GEMMs
run them and the kernel does the rest between them, three calls per layer. greedy_decode() runs a multi-step
call's later greedy steps (embedding to argmax) in one call.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kernels import cpu_extension, cpu_gemv


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One layer's parameters (biases None where absent) and shape; tensors, so a reloaded weight is followed.
    A projection may be int8 with a float32 scale per output row (weight-only quantization): its *_scale. A bf16
    projection may come with its kernels.cpu_gemv.pair_weight copy (*_pairs), which its products then read.
    q_norm and k_norm: an RMSNorm weight [head_dim] each q and k head goes through before rotary (Qwen3), with the
    layer's eps, or None."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    cos: torch.Tensor  # float32 [max_position, head_dim]
    sin: torch.Tensor
    eps: float
    scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
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

    def max_rows(self) -> int:
        """The most tokens of a step whose products the kernels run for these projections (max_rows)."""
        return max_rows(self.input_norm.dtype, [self.qkv, self.o, self.gate_up, self.down], self._pairs())

    def pointers(self) -> list[int]:
        tensors = (self.input_norm, self.qkv, self.qkv_bias, self.o, self.o_bias, self.post_norm, self.gate_up,
                   self.down, self.cos, self.sin, self.qkv_scale, self.o_scale, self.gate_up_scale, self.down_scale,
                   *self._pairs(), self.q_norm, self.k_norm)
        return [0 if t is None else t.data_ptr() for t in tensors]

    def check_dtypes(self, dtype: torch.dtype) -> None:
        """Each projection of the hidden states' dtype, or int8 with its float32 scales (per row or group)."""
        for weight, scale in self._projections():
            int8 = weight.dtype == torch.int8 and scale is not None and scale.dtype == torch.float32 \
                and scale.is_contiguous() and _scale_group(weight, scale) is not None
            if not (int8 or (weight.dtype == dtype and scale is None)):
                raise TypeError("a projection's weight must be of the hidden states' dtype, or int8 with float32 "
                                "scales per row [N] or per group of a multiple of 8 columns [N, K / group]")
        for norm in (self.q_norm, self.k_norm):
            if norm is not None and not (norm.dtype == dtype and norm.shape == (self.head_dim,)
                                         and norm.is_contiguous()):
                raise ValueError("a q or k head norm must be a contiguous [head_dim] weight of the hidden states' dtype")
        for (weight, _), pairs in zip(self._projections(), self._pairs()):
            if pairs is not None and not (weight.dtype == dtype == torch.bfloat16 and cpu_gemv.pairs_serve(weight)
                                          and cpu_gemv.fits_pairs(weight, pairs)):
                raise ValueError("a projection's pairs must be kernels.cpu_gemv.pair_weight of its bf16 weight, on a "
                                 "CPU with AVX-512 BF16")

    def dims(self) -> list[int]:
        groups = [0 if scale is None else _scale_group(weight, scale) for weight, scale in self._projections()]
        return [self.qkv.shape[1], self.num_heads, self.num_kv_heads, self.head_dim, self.down.shape[1],
                self.sliding_window or 0, *groups]

    def _projections(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        return ((self.qkv, self.qkv_scale), (self.o, self.o_scale), (self.gate_up, self.gate_up_scale),
                (self.down, self.down_scale))

    def _pairs(self) -> tuple[torch.Tensor | None, ...]:
        return self.qkv_pairs, self.o_pairs, self.gate_up_pairs, self.down_pairs


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
    """A stage's layers, their (key, value) caches and the final norm as the kernel takes them, checked and turned
    into pointer lists once rather than every step (the weights stay where loading put them; a model makes these
    again when its caches are bound anew)."""

    def __init__(self, layers: Sequence[DecoderLayerWeights], caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype, final_norm: torch.Tensor | None = None, final_eps: float = 0.0) -> None:
        self.module = _checked(layers, caches, dtype, final_norm)
        self.layers, self.caches, self.dtype = list(layers), list(caches), dtype
        self.pointers = [w.pointers() for w in layers]
        self.dims = [w.dims() for w in layers]
        self.eps = [w.eps for w in layers]
        self.scales = [w.scale for w in layers]
        self.key_caches = [k.data_ptr() for k, _ in caches]
        self.value_caches = [v.data_ptr() for _, v in caches]
        self.block_size = caches[0][0].shape[2]
        self.final_norm, self.final_eps = final_norm, final_eps

    def check(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype:
            raise TypeError(f"the layers were prepared for {self.dtype}, not {x.dtype}")

    def serves(self, caches: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> bool:
        """Whether these are still the caches (and dtype) it was prepared for."""
        return dtype == self.dtype and len(caches) == len(self.caches) and all(
            a is b for a, b in zip(caches, self.caches))


def decoder_layers(prepared: PreparedLayers, x: torch.Tensor, residual: torch.Tensor | None, step: DecodeStep
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepared layers in order in one call: (mlp output, residual) as the last one's forward returns them; with
    a final norm, (the model's RMSNorm of their sum, the sum) as its norm returns them. Saves the per-layer Python
    and dispatch of a step (~0.3 ms per token of batch-1 decode on the benchmark model)."""
    prepared.check(x)
    x = x.contiguous()  # kept in locals: the kernel gets raw pointers, which must outlive the call
    residual = None if residual is None else residual.contiguous()
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    final_norm = prepared.final_norm
    prepared.module.decoder_layers(
        x.dtype == torch.bfloat16, prepared.pointers, prepared.dims, prepared.eps, prepared.scales,
        prepared.key_caches, prepared.value_caches, 0 if final_norm is None else final_norm.data_ptr(),
        prepared.final_eps, x.data_ptr(), 0 if residual is None else residual.data_ptr(), out.data_ptr(),
        residual_out.data_ptr(), step.positions.data_ptr(), step.slot_mapping.data_ptr(), prepared.block_size,
        step.block_tables.data_ptr(), step.block_tables.shape[1], step.seq_lens.data_ptr(), x.shape[0])
    return out, residual_out


def decoder_layers_with_products(prepared: PreparedLayers,
                                 products: Sequence[tuple[Product, Product, Product, Product]], x: torch.Tensor,
                                 residual: torch.Tensor | None, step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
    """decoder_layers() for a step of more tokens than the kernels' products take: each layer's (qkv, o, gate_up,
    down) products are the given functions (the model's linear layers: torch's GEMMs), everything between them the
    kernel's, in three calls per layer instead of the op path's ~50 tensor ops."""
    prepared.check(x)
    module = prepared.module
    bf16, tokens, hidden = x.dtype == torch.bfloat16, x.shape[0], x.shape[1]
    rows = step.positions.data_ptr(), step.slot_mapping.data_ptr()
    tables = step.block_tables.data_ptr(), step.block_tables.shape[1], step.seq_lens.data_ptr()
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    residual_out, normed = torch.empty_like(x), torch.empty_like(x)
    for i, (weights, (qkv_proj, o_proj, gate_up_proj, down_proj), pointers, dims) in enumerate(
            zip(prepared.layers, products, prepared.pointers, prepared.dims, strict=True)):
        before = residual_out.data_ptr() if i else 0 if residual is None else residual.data_ptr()
        module.add_and_norm(bf16, x.data_ptr(), before, weights.input_norm.data_ptr(), weights.eps,
                            residual_out.data_ptr(), normed.data_ptr(), tokens, hidden)
        qkv = qkv_proj(normed).contiguous()
        attn = torch.empty(tokens, weights.num_heads * weights.head_dim, dtype=x.dtype)
        module.attend(bf16, pointers, dims, weights.eps, weights.scale, qkv.data_ptr(), *rows, prepared.key_caches[i],
                      prepared.value_caches[i], prepared.block_size, *tables, attn.data_ptr(), tokens)
        o = o_proj(attn).contiguous()
        module.add_and_norm(bf16, o.data_ptr(), residual_out.data_ptr(), weights.post_norm.data_ptr(), weights.eps,
                            residual_out.data_ptr(), normed.data_ptr(), tokens, hidden)
        gate_up = gate_up_proj(normed).contiguous()
        act = torch.empty(tokens, gate_up.shape[1] // 2, dtype=x.dtype)
        module.silu_and_mul(bf16, gate_up.data_ptr(), act.data_ptr(), tokens, act.shape[1])
        x = down_proj(act).contiguous()
    if prepared.final_norm is None:
        return x, residual_out
    module.add_and_norm(bf16, x.data_ptr(), residual_out.data_ptr(), prepared.final_norm.data_ptr(),
                        prepared.final_eps, residual_out.data_ptr(), normed.data_ptr(), tokens, hidden)
    return normed, residual_out


@dataclass(frozen=True)
class PromptLookupDrafts:
    """Drafts that greedy_decode() proposes and verifies itself: prompt lookup (workers/spec_decode/ngram.py) of up to
    k tokens over each row's history (all its tokens, its last one's included)."""

    k: int
    min_n: int
    max_n: int
    history: Sequence[Sequence[int]]


@dataclass(frozen=True)
class DraftModelDrafts:
    """Drafts that greedy_decode() has a draft model with the target's vocabulary write, up to k per step, as
    workers/spec_decode/draft_model.py drafts for greedy rows (its argmax, one token at a time): the draft's prepared
    layers (with their caches over the target's block ids, and the final norm), embedding and LM head, all of the
    target's dtype. history: each row's tokens, as PromptLookupDrafts'; known: int64 [rows], how many of each row's
    positions the draft's K/V holds (at most its last token's position), then updated in place to how many it was
    fed (those below the row's last token's position hold its tokens). After the last step the kernel writes into
    next (int64 [rows, k]) the k drafts of each row that goes on with k slots from its last token on (capacity:
    int64 [rows], the positions its blocks and the model length give), -1 for the others."""

    k: int
    prepared: PreparedLayers
    embedding: torch.Tensor
    head: torch.Tensor
    vocab_size: int
    history: Sequence[Sequence[int]]
    known: np.ndarray
    capacity: np.ndarray
    next: np.ndarray
    head_pairs: torch.Tensor | None = None  # the head's kernels.cpu_gemv.pair_weight copy, where the draft keeps one


@dataclass(frozen=True)
class SampledRows:
    """Rows greedy_decode() samples instead of taking the argmax: those with temperature > 0 (float32 [rows]; 0: the
    argmax), by kernels/csrc/sample.h's rule (Sampler's: top_k <= 0, top_p 1 and min_p 0 are none) at uniform[m, i]
    (float64 [rows, steps]) for row m's i-th token."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    uniform: np.ndarray


@dataclass(frozen=True)
class GreedyRun:
    """greedy_decode()'s result. tokens [rows, columns]: each row's tokens in order, then -1. verified [rows, steps,
    2]: each step's drafted and accepted counts (-1 where the row verified no draft); None without drafts.
    failed [rows]: a sampled row that had no token to draw (a NaN, or no finite logit) and stopped there."""

    tokens: np.ndarray
    verified: np.ndarray | None
    failed: np.ndarray


def greedy_decode(prepared: PreparedLayers, embedding: torch.Tensor, head: torch.Tensor, vocab_size: int,
                  tokens: np.ndarray, positions: np.ndarray, table: np.ndarray, limits: np.ndarray,
                  stops: Sequence[Collection[int]], steps: int,
                  drafts: PromptLookupDrafts | DraftModelDrafts | None = None, max_rows: int | None = None,
                  sampled: SampledRows | None = None, head_pairs: torch.Tensor | None = None) -> GreedyRun:
    """Up to `steps` greedy steps for each row from its last token `tokens[m]` at `positions[m]`: per step the
    embedding lookup, decoder_layers() with the final norm, the LM head `head` [rows, hidden] by the GEMV kernel and
    the first argmax among its first vocab_size logits, as the model computes them, all in C++. Row m takes up to
    limits[m] tokens (its K/V slots come from its row of `table`, [rows, max_blocks] block ids) and none after a
    step that gave it a token of stops[m]. With `drafts` a step also feeds each row its drafts (prompt lookup's, or
    a draft model's: as many as its limit leaves room for, at most max_rows token rows in all, None: no cap) and
    keeps those the argmax agrees with, and the argmax after them: the same tokens. With `sampled` (no drafts then)
    its rows with a temperature draw their tokens as the sampler does. `head_pairs`: the head's
    kernels.cpu_gemv.pair_weight copy, which its products then read (as the model's compute_logits() does)."""
    _check_model(prepared, embedding, head, prepared.dtype, head_pairs)
    rows = len(tokens)
    tokens, positions, limits = (np.ascontiguousarray(a, dtype=np.int64) for a in (tokens, positions, limits))
    table = np.ascontiguousarray(table, dtype=np.int64)
    if table.shape[0] != rows or len(positions) != rows or len(limits) != rows or len(stops) != rows:
        raise ValueError("tokens, positions, table, limits and stops need one entry per row")
    stop_ids, stop_starts = _flat(stops)
    k = 0 if drafts is None else drafts.k
    if drafts is not None:
        if len(drafts.history) != rows or min(getattr(drafts, "min_n", 1), k) < 1:
            raise ValueError("drafts need a history per row, and k (and prompt lookup's min_n) of 1 at least")
        history, history_starts = _flat(drafts.history)
        verified = np.empty((rows, steps, 2), dtype=np.int64)
    else:
        history = history_starts = verified = np.zeros(1, dtype=np.int64)
    draft_model, known = None, np.zeros(1, dtype=np.int64)
    if isinstance(drafts, DraftModelDrafts):
        draft_model, known = _draft_model_args(drafts, prepared, embedding.shape[0], np.diff(history_starts)), \
            drafts.known
    pointers: list[int] = []
    if sampled is not None:
        if drafts is not None:
            raise ValueError("sampled rows verify no drafts here (their verification is the rejection sampler's)")
        arrays = (np.ascontiguousarray(sampled.temperature, dtype=np.float32),
                  np.ascontiguousarray(sampled.top_k, dtype=np.int64),
                  np.ascontiguousarray(sampled.top_p, dtype=np.float32),
                  np.ascontiguousarray(sampled.min_p, dtype=np.float32),
                  np.ascontiguousarray(sampled.uniform, dtype=np.float64))
        if any(len(a) != rows for a in arrays) or arrays[4].shape != (rows, steps):
            raise ValueError("sampled rows need one temperature, top_k, top_p and min_p per row, and [rows, steps] "
                             "uniform draws")
        pointers = [a.ctypes.data for a in arrays]
    columns = max(1, min(int(limits.max(initial=0)), steps * (1 + k)))
    row_budget = rows * (1 + k) if max_rows is None else max(rows, max_rows)
    out = np.empty((rows, columns), dtype=np.int64)
    prepared.module.greedy_decode(
        prepared.dtype == torch.bfloat16, prepared.pointers, prepared.dims, prepared.eps, prepared.scales,
        prepared.key_caches, prepared.value_caches, prepared.final_norm.data_ptr(), prepared.final_eps,
        embedding.data_ptr(), head.data_ptr(), head.shape[0], vocab_size, _pointer(head_pairs), tokens.ctypes.data,
        positions.ctypes.data,
        table.ctypes.data, table.shape[1], prepared.block_size, limits.ctypes.data, stop_ids.ctypes.data,
        stop_starts.ctypes.data, [k, getattr(drafts, "min_n", 1), getattr(drafts, "max_n", 0)],
        history.ctypes.data, history_starts.ctypes.data, verified.ctypes.data if drafts else 0, pointers,
        draft_model, known.ctypes.data, row_budget, out.ctypes.data, columns, rows, steps)
    return GreedyRun(out, verified if drafts else None, (out == -2).any(axis=1))


def _check_model(prepared: PreparedLayers, embedding: torch.Tensor, head: torch.Tensor, dtype: torch.dtype,
                 head_pairs: torch.Tensor | None) -> None:
    """A whole model for greedy_decode(): layers prepared with the final norm, embedding and head, all of `dtype`;
    the head's pairs copy, if given, fits it."""
    if prepared.final_norm is None:
        raise ValueError("greedy decoding needs the last stage's final norm")
    if prepared.dtype != dtype:
        raise TypeError(f"the layers were prepared for {prepared.dtype}, not {dtype}")
    for name, tensor in (("embedding", embedding), ("head", head)):
        if tensor.dtype != dtype or tensor.device.type != "cpu" or tensor.dim() != 2 or not tensor.is_contiguous():
            raise ValueError(f"the {name} must be a contiguous CPU matrix of the layers' dtype {dtype}")
    if head_pairs is not None and not (dtype == torch.bfloat16 and cpu_gemv.pairs_serve(head)
                                       and cpu_gemv.fits_pairs(head, head_pairs)):
        raise ValueError("head_pairs must be kernels.cpu_gemv.pair_weight of the bf16 head, on a CPU with AVX-512 BF16")


def _draft_model_args(drafts: DraftModelDrafts, target: PreparedLayers, target_vocab: int, lengths: np.ndarray
                      ) -> tuple:
    """The draft model as the kernel takes it, once it is found to fit the target's steps (its tokens index the
    target's embedding of target_vocab rows; lengths: each row's history length)."""
    draft = drafts.prepared
    _check_model(draft, drafts.embedding, drafts.head, target.dtype, drafts.head_pairs)
    if drafts.vocab_size > target_vocab:
        raise ValueError("the draft's vocabulary must be the target's")
    if draft.block_size != target.block_size:
        raise ValueError("the draft's caches must have the target's block size (they share its block table)")
    for name, shape in (("known", lengths.shape), ("capacity", lengths.shape), ("next", (len(lengths), drafts.k))):
        array = getattr(drafts, name)
        if not (isinstance(array, np.ndarray) and array.dtype == np.int64 and array.flags.c_contiguous
                and array.flags.writeable and array.shape == shape):
            raise ValueError(f"{name} must be a writable contiguous int64 array of shape {shape}")
    if not ((drafts.known >= 0) & (drafts.known < lengths)).all():
        raise ValueError("a row's draft K/V must be known up to its last token's position at most")
    return (draft.pointers, draft.dims, draft.eps, draft.scales, draft.key_caches, draft.value_caches,
            draft.final_norm.data_ptr(), draft.final_eps, drafts.embedding.data_ptr(), drafts.head.data_ptr(),
            drafts.head.shape[0], drafts.vocab_size, _pointer(drafts.head_pairs), drafts.capacity.ctypes.data,
            drafts.next.ctypes.data)


def _pointer(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _flat(lists: Sequence[Collection[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ints as one int64 array and each one's start in it (with the end after the last)."""
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64)
    return flat, np.concatenate(([0], np.cumsum([len(row) for row in lists], dtype=np.int64)))


def _checked(layers: Sequence[DecoderLayerWeights], caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             dtype: torch.dtype, final_norm: torch.Tensor | None) -> ModuleType:
    """The kernels' module, once the layers, caches and final norm are found fit for hidden states of `dtype`."""
    module = cpu_extension.load()
    if module is None:
        raise RuntimeError("the C++ CPU kernels could not be built")
    if not layers:
        raise ValueError("no layers to run")
    for weights, (key_cache, value_cache) in zip(layers, caches, strict=True):
        if key_cache.dtype != dtype or value_cache.dtype != dtype or weights.input_norm.dtype != dtype:
            raise TypeError("the caches and norms must share the hidden states' dtype")
        weights.check_dtypes(dtype)
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("the caches must be contiguous")
    if final_norm is not None and final_norm.dtype != dtype:
        raise TypeError("the final norm must share the hidden states' dtype")
    return module
