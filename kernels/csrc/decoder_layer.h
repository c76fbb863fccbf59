// One decoder layer of any of the families it describes (DecoderLayer) for a step of few tokens, in one call: what
// the Python layer computes op by op, with the same roundings to the model dtype, but without ~50 tensor ops'
// dispatch per layer. Its phases between the products are also called one by one where torch runs the products.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "decode_attention.h"
#include "gemv.h"
#include "experts.h"
#include "gemv_pairs.h"
#include "layer_ops.h"
#include "lora.h"
#include "mla.h"
#include "projection.h"
#include "tp_reduce.h"

namespace pagedserve {

// A decoder layer as data: what a family's layer computes, llama's by default. Its norms share one kind
// (layer_ops.h: RMSNorm, Gemma's, LayerNorm) and eps; attn_out_norm and mlp_out_norm (Gemma 2's sandwich norms)
// normalize the attention's and the MLP's outputs before they join the residual stream, where given. A parallel
// residual (GPT-NeoX) adds attention and MLP, each from its own norm of the same input. gate_up is [gate | up] for a
// gated activation, else the MLP's one up product. rotary_dim: the leading dims of each head that rotate (0: none,
// positions are learned); qkv_per_head: qkv holds each head's q, k and v rows together (GPT-NeoX) instead of all
// q, then all k, then all v; scale_q_first: q is scaled and rounded before its scores (scale 1 there: OPT).
template <typename T>
struct DecoderLayer {
  Norm<T> input_norm, post_norm, attn_out_norm, mlp_out_norm;  // post_norm: before the MLP
  const T *qkv_bias = nullptr, *o_bias = nullptr, *gate_up_bias = nullptr, *down_bias = nullptr;  // null: none
  Projection qkv, o, gate_up, down;
  const float *cos = nullptr, *sin = nullptr;  // [max_position, rotary_dim]
  float scale = 1.f, soft_cap = 0.f;  // soft_cap > 0: scores capped by tanh (Gemma 2)
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0, window = 0, rotary_dim = 0;
  int64_t activation = kSiluGlu;
  bool parallel_residual = false, qkv_per_head = false, scale_q_first = false;
  // [head_dim] weights of each q and k head's norm (Qwen3's RMSNorm, Gemma 3's (1 + w) one: the layer's kind), or
  // null
  const T *q_norm = nullptr, *k_norm = nullptr;
  Experts<T> experts;  // count > 0: a mixture of experts (experts.h), the dense MLP its shared expert if any
  // MLA (mla.h, mla.lora > 0): qkv is the q projection (V3: q_b, from mla_q_a's normed rows), mla_kv_a the latent's;
  // head_dim is the cache row's lora + rope, kv_heads 1.
  Mla<T> mla;
  Projection mla_q_a{}, mla_kv_a{};
};

// The widths of a row of qkv (MLA: q then the latent's kv_a) and of the attention's output (o's input).
template <typename T>
int64_t qkv_width(const DecoderLayer<T>& L) {
  if (L.mla.lora) return L.heads * (L.mla.nope + L.mla.rope) + L.mla.lora + L.mla.rope;
  return (L.heads + 2 * L.kv_heads) * L.head_dim;
}
template <typename T>
int64_t attn_width(const DecoderLayer<T>& L) {
  return L.heads * (L.mla.lora ? L.mla.v : L.head_dim);
}

// Rows of add_and_norm_row, over the threads for many; in place is fine.
template <typename T>
void add_and_norm_rows(const T* x, const T* residual, const Norm<T>& norm, T* residual_out, T* out, int64_t M,
                       int64_t H) {
#pragma omp parallel for if (M * H >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m)
    add_and_norm_row(x + m * H, residual ? residual + m * H : nullptr, norm, residual_out + m * H, out + m * H, H);
}

// Before attention: residual_out = x + residual (x alone in the first layer), normed = its input norm.
template <typename T>
void before_attention(const DecoderLayer<T>& L, const T* x, const T* residual, T* residual_out, T* normed,
                      int64_t M) {
  add_and_norm_rows(x, residual, L.input_norm, residual_out, normed, M, L.hidden);
}

// After attention's output o: normed = the MLP's input. In sequence, o (its norm first, where the layer has one)
// joins residual_out; in parallel, residual_out stays the layer's input and o waits for the MLP's output.
template <typename T>
void after_attention(const DecoderLayer<T>& L, T* o, T* residual_out, T* normed, int64_t M) {
  const int64_t H = L.hidden;
#pragma omp parallel for if (M * H >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m) {
    T *row = o + m * H, *stream = residual_out + m * H;
    if (L.parallel_residual) {
      norm_row(L.post_norm, stream, normed + m * H, H);
      continue;
    }
    if (L.attn_out_norm.weight) norm_row(L.attn_out_norm, row, row, H);
    add_and_norm_row(row, static_cast<const T*>(stream), L.post_norm, stream, normed + m * H, H);
  }
}

// The MLP's activation: h [M, 2I] of [gate | up] rows (gated) or [M, I] into act [M, I].
template <typename T>
void activate_rows(const DecoderLayer<T>& L, const T* h, T* act, int64_t M) {
  const int64_t I = L.intermediate, width = gated(L.activation) ? 2 * I : I;
#pragma omp parallel for if (M * I >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m) activate_row(L.activation, h + m * width, act + m * I, I);
}

// After the MLP's output out [M, hidden] (in place): its norm where the layer has one, and in parallel the
// attention's output o added. What the next layer (or the final norm) adds to residual_out.
template <typename T>
void after_mlp(const DecoderLayer<T>& L, T* out, const T* o, int64_t M) {
  const int64_t H = L.hidden;
  if (!L.mlp_out_norm.weight && !L.parallel_residual) return;
#pragma omp parallel for if (M * H >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m) {
    T* row = out + m * H;
    if (L.mlp_out_norm.weight) norm_row(L.mlp_out_norm, row, row, H);
    if (L.parallel_residual)
      for (int64_t d = 0; d < H; ++d) row[d] = round_to<T>(widen(row[d]) + widen(o[m * H + d]));
  }
}

// A q or k head norm: the layer's norm kind and eps, without a bias.
template <typename T>
Norm<T> head_norm(const DecoderLayer<T>& L, const T* weight) {
  return Norm<T>{L.input_norm.kind, weight, nullptr, L.input_norm.eps};
}

// The attention between the layer's qkv and o products: q/k norms where the layer has them, then rotary on q and k
// of qkv [M, q + 2 kv] (in place), the step's K/V written into the caches [blocks, kv_heads, block_size, head_dim]
// (a negative slot writes none; an fp8 cache stores them quantized), and each row's attention over its sequence into
// attn [M, q].
template <typename T>
void attend(const DecoderLayer<T>& L, T* qkv, const int64_t* positions, const int64_t* slots, const KvCache& cache,
            int64_t block_size, const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, T* attn,
            int64_t M) {
  if (L.mla.lora) {
    const int64_t width = qkv_width(L);
    return mla_attend(L.mla, L.heads, L.cos, L.sin, L.scale, qkv, width, qkv + width - L.mla.lora - L.mla.rope, width,
                      positions, slots, cache, block_size, tables, max_blocks, seq_lens, attn, M);
  }
  const int64_t D = L.head_dim, R = L.rotary_dim, q_size = L.heads * D, kv_size = L.kv_heads * D;
  const int64_t qkv_size = q_size + 2 * kv_size;
  // Where head h's q, k and v start in a row.
  const int64_t q_step = L.qkv_per_head ? 3 * D : D, k_at = L.qkv_per_head ? D : q_size;
  const int64_t v_at = L.qkv_per_head ? 2 * D : q_size + kv_size;
  Scratch<T> q(M * q_size);
#pragma omp parallel for if (M * qkv_size >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m) {
    T* row = qkv + m * qkv_size;
    const float *cos = L.cos + positions[m] * R, *sin = L.sin + positions[m] * R;
    for (int64_t h = 0; h < L.heads; ++h) {
      T* head = row + h * q_step;
      if (L.q_norm) norm_row(head_norm(L, L.q_norm), head, head, D);
      if (R) rotate(head, R, cos, sin);
      T* to = q.data() + m * q_size + h * D;
      if (L.scale_q_first)
        for (int64_t d = 0; d < D; ++d) to[d] = round_to<T>(widen(head[d]) * L.scale);
      else
        std::copy(head, head + D, to);
    }
    for (int64_t h = 0; h < L.kv_heads; ++h) {
      T* head = row + k_at + h * q_step;
      if (L.k_norm) norm_row(head_norm(L, L.k_norm), head, head, D);
      if (R) rotate(head, R, cos, sin);
    }
    if (slots[m] < 0) continue;
    const int64_t block = slots[m] / block_size, offset = slots[m] % block_size;
    auto write = [&](auto* typed) {
      using C = std::remove_pointer_t<decltype(typed)>;
      for (int64_t h = 0; h < L.kv_heads; ++h) {
        const int64_t at = ((block * L.kv_heads + h) * block_size + offset) * D;
        store_row(row + k_at + h * q_step, static_cast<C*>(cache.k) + at, D, cache.k_scale);
        store_row(row + v_at + h * q_step, static_cast<C*>(cache.v) + at, D, cache.v_scale);
      }
    };
    if (cache.kind == kCacheE4m3) write(static_cast<Fp8E4m3*>(nullptr));
    else if (cache.kind == kCacheE5m2) write(static_cast<Fp8E5m2*>(nullptr));
    else write(static_cast<T*>(nullptr));
  }
  decode_any<T>(q.data(), cache, tables, seq_lens, attn, M, L.heads, L.kv_heads, block_size, D, max_blocks,
                L.scale_q_first ? 1.f : L.scale, L.soft_cap, L.window);
}

// MLA's products (q: V3's q_a, its norm and q_b; kv_a) from normed [M, hidden], then its attention into attn.
template <typename T>
void mla_layer_attention(const DecoderLayer<T>& L, const T* normed, const int64_t* positions, const int64_t* slots,
                         const KvCache& cache, int64_t block_size, const int64_t* tables, int64_t max_blocks,
                         const int64_t* seq_lens, T* attn, int64_t M, const int64_t* lora_slots) {
  const Mla<T>& A = L.mla;
  const int64_t H = L.hidden, q_size = L.heads * (A.nope + A.rope), kv_size = A.lora + A.rope;
  std::vector<T> q(M * q_size), kv(M * kv_size), q_a(M * A.q_lora);
  // The products of normed (kv_a and q, or V3's q_a) in one parallel region where both read bf16 pairs copies.
  bool together = false;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const Projection& first = A.q_lora ? L.mla_q_a : L.qkv;
  if constexpr (std::is_same_v<T, uint16_t>)
    if ((together = paired(first) && paired(L.mla_kv_a))) {
      gemv_pairs_together(normed, {{first.pairs, A.q_lora ? nullptr : L.qkv_bias, A.q_lora ? q_a.data() : q.data(),
                                    A.q_lora ? A.q_lora : q_size}, {L.mla_kv_a.pairs, nullptr, kv.data(), kv_size}},
                          M, H);
      if (!A.q_lora) add_lora(L.qkv.lora, normed, q.data(), M, q_size, H, lora_slots);
    }
#endif
  if (!together) {
    project(L.mla_kv_a, normed, static_cast<const T*>(nullptr), kv.data(), M, kv_size, H, nullptr);
    if (A.q_lora) project(L.mla_q_a, normed, static_cast<const T*>(nullptr), q_a.data(), M, A.q_lora, H, nullptr);
  }
  if (A.q_lora) {
    const Norm<T> norm{kRmsNorm, A.q_a_norm, nullptr, A.eps};
    for (int64_t m = 0; m < M; ++m) norm_row(norm, q_a.data() + m * A.q_lora, q_a.data() + m * A.q_lora, A.q_lora);
  }
  // V3's q_b in the heads' region where it reads its pairs copy alone (no bias, no adapter)
  const bool q_joined = joins_query(A) && paired(L.qkv) && !L.qkv_bias && !(lora_slots && L.qkv.lora.a);
  if ((A.q_lora && !q_joined) || !together)
    project(L.qkv, A.q_lora ? q_a.data() : normed, L.qkv_bias, q.data(), M, q_size, A.q_lora ? A.q_lora : H,
            lora_slots);
  mla_attend(A, L.heads, L.cos, L.sin, L.scale, q.data(), q_size, kv.data(), kv_size, positions, slots, cache,
             block_size, tables, max_blocks, seq_lens, attn, M,
             q_joined ? QueryProduct<T>{q_a.data(), L.qkv.pairs, q.data()} : QueryProduct<T>{});
}

// The layer's dense MLP: its up product(s), activation and down product from normed [M, hidden] into out; with a
// tensor-parallel group `tp`, this rank's shard of it, whose down product is reduced over the group.
template <typename T>
void dense_mlp(const DecoderLayer<T>& L, const T* normed, T* out, int64_t M, const int64_t* lora_slots,
               const ShmGroup* tp = nullptr) {
  const int64_t H = L.hidden, I = L.intermediate, width = gated(L.activation) ? 2 * I : I;
  Scratch<T> h(M * width), act(M * I);
  project(L.gate_up, normed, L.gate_up_bias, h.data(), M, width, H, lora_slots);
  activate_rows(L, h.data(), act.data(), M);
  project(L.down, act.data(), tp ? nullptr : L.down_bias, out, M, H, I, lora_slots);
  if (tp) reduce_rows(*tp, out, L.down_bias, M, H);
}

// The layer's shared expert as the routed experts' products take it (experts.h), where both read bf16 pairs copies
// and it has no biases or adapters; else none (dense_mlp runs it).
template <typename T>
SharedExpert<T> joined_shared_expert(const DecoderLayer<T>& L, T* out, const int64_t* lora_slots) {
  const bool joins = kExpertPairs && std::is_same_v<T, uint16_t> && L.experts.gate_up_pairs && L.experts.down_pairs &&
                     paired(L.gate_up) && paired(L.down) && !L.gate_up_bias && !L.down_bias && gated(L.activation) &&
                     (!lora_slots || (!L.gate_up.lora.a && !L.down.lora.a));
  if (!joins) return {};
  return {L.gate_up.pairs, L.down.pairs, L.intermediate, L.activation, out};
}

// x [M, hidden] (this layer's input), residual [M, hidden] or null (first layer); writes out [M, hidden] and
// residual_out [M, hidden] (either may be x or residual: each is read before it is written). The layer's output is
// out + residual_out, which the next layer's before_attention() adds. lora_slots: each row's adapter slot (-1: none;
// null: no row has one). tp: the tensor-parallel group whose shard of the layer this rank computes (its heads, its
// slice of each MLP; null: the whole layer): its o and down products, and a mixture's routed and shared experts,
// are reduced over it.
template <typename T>
void decoder_layer(const DecoderLayer<T>& L, const T* x, const T* residual, T* out, T* residual_out,
                   const int64_t* positions, const int64_t* slots, const KvCache& cache, int64_t block_size,
                   const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, int64_t M,
                   const int64_t* lora_slots, const ShmGroup* tp = nullptr) {
  const int64_t H = L.hidden, attn_size = attn_width(L);
  Scratch<T> normed(M * H), attn(M * attn_size);
  before_attention(L, x, residual, residual_out, normed.data(), M);
  if (L.mla.lora) {
    mla_layer_attention(L, normed.data(), positions, slots, cache, block_size, tables, max_blocks, seq_lens,
                        attn.data(), M, lora_slots);
  } else {
    Scratch<T> qkv(M * qkv_width(L));
    project(L.qkv, normed.data(), L.qkv_bias, qkv.data(), M, qkv_width(L), H, lora_slots);
    attend(L, qkv.data(), positions, slots, cache, block_size, tables, max_blocks, seq_lens, attn.data(), M);
  }
  Scratch<T> o(M * H);
  project(L.o, attn.data(), tp ? nullptr : L.o_bias, o.data(), M, H, attn_size, lora_slots);
  if (tp) reduce_rows(*tp, o.data(), L.o_bias, M, H);
  after_attention(L, o.data(), residual_out, normed.data(), M);
  if (L.experts.count) {
    Scratch<T> shared(L.gate_up.weight ? M * H : 0);  // a shared expert's output
    const SharedExpert<T> joined = joined_shared_expert(L, shared.data(), lora_slots);
    mixture_of_experts(L.experts, normed.data(), out, M, H, joined);
    if (tp) all_reduce(*tp, out, M * H);  // each rank's experts hold a slice of every expert's MLP
    if (L.gate_up.weight) {
      if (!joined.gate_up) dense_mlp(L, normed.data(), shared.data(), M, lora_slots, tp);
      else if (tp) all_reduce(*tp, shared.data(), M * H);
      add_shared_expert(L.experts, normed.data(), shared.data(), out, M, H);
    }
  } else {
    dense_mlp(L, normed.data(), out, M, lora_slots, tp);
  }
  after_mlp(L, out, o.data(), M);
}

// A stage's layers in order, the hidden states and residual carried in out and residual_out (x and residual are
// only read; residual null before the first layer), then the final norm if final_norm is set: out = its norm,
// residual_out = the last sum (a null final_norm.weight: none). One cache per layer.
template <typename T>
void stage_layers(const std::vector<DecoderLayer<T>>& layers, const std::vector<KvCache>& caches,
                  const Norm<T>& final_norm, const T* x, const T* residual,
                  T* out, T* residual_out, const int64_t* positions, const int64_t* slots, int64_t block_size,
                  const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, int64_t M,
                  const int64_t* lora_slots = nullptr, const ShmGroup* tp = nullptr) {
  for (size_t i = 0; i < layers.size(); ++i)
    decoder_layer(layers[i], i ? out : x, i ? residual_out : residual, out, residual_out, positions, slots,
                  caches[i], block_size, tables, max_blocks, seq_lens, M, lora_slots, tp);
  if (final_norm.weight) add_and_norm_rows(out, residual_out, final_norm, residual_out, out, M, layers.front().hidden);
}

}  // namespace pagedserve
