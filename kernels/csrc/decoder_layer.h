// One llama-style decoder layer for a step of few tokens, in one call: what the Python layer computes op by op,
// with the same roundings to the model dtype, but without ~50 tensor ops' dispatch per layer.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "decode_attention.h"
#include "gemv.h"
#include "gemv_pairs.h"

namespace pagedserve {

// A projection's weight: T, or int8 with a float32 scale per output row or per group of input columns
// (weight-only quantization).
struct Projection {
  const void* weight;
  const float* scale;  // null: the weight is of the model dtype
  int64_t group;  // 0: one scale per row; else the columns sharing a scale (scale is [N, K / group])
  const uint16_t* pairs = nullptr;  // a bf16 weight's gemv_pairs.h copy, which its products then read; or null
};

// y = x W^T + b from W's pairs copy where it has one (bf16 on AVX-512 BF16 CPUs), else from W.
template <typename T>
void products(const T* x, const T* w, const uint16_t* pairs, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if (pairs) return gemv_pairs_bf16(x, pairs, bias, y, M, N, K);
#endif
  gemv(x, w, bias, y, M, N, K);
}

template <typename T>
struct DecoderLayer {
  const T *input_norm, *qkv_bias, *o_bias, *post_norm;  // biases may be null
  Projection qkv, o, gate_up, down;
  const float *cos, *sin;  // [max_position, head_dim]
  float eps, scale;
  int64_t hidden, heads, kv_heads, head_dim, intermediate, window;
  const T *q_norm = nullptr, *k_norm = nullptr;  // [head_dim] RMSNorm weights of each q and k head (Qwen3), or null
};

template <typename T>
void project(const Projection& p, const T* x, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
  if (p.scale && p.group)
    gemv_grouped(x, static_cast<const int8_t*>(p.weight), p.scale, bias, y, M, N, K, p.group);
  else if (p.scale)
    gemv(x, static_cast<const int8_t*>(p.weight), bias, y, M, N, K, p.scale);
  else
    products(x, static_cast<const T*>(p.weight), p.pairs, bias, y, M, N, K);
}

template <typename T>
inline T round_to(float x) {
  T out;
  store(x, &out);
  return out;
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)) for one row, statistics in float32 (HF's RMSNorm). The squares
// sum in 16 lanes (torch's own reduction is vectorized too: neither sums in index order).
template <typename T>
void rms_norm_row(const T* x, const T* weight, float eps, T* out, int64_t dim) {
  float sq = 0.f;
  int64_t d = 0;
#ifdef __AVX2__
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  for (; d + 16 <= dim; d += 16) {
    const __m256 a = load8(x + d), b = load8(x + d + 8);
    even = _mm256_fmadd_ps(a, a, even);
    odd = _mm256_fmadd_ps(b, b, odd);
  }
  for (; d + 8 <= dim; d += 8) even = _mm256_fmadd_ps(load8(x + d), load8(x + d), even);
  sq = hsum(_mm256_add_ps(even, odd));
#endif
  for (; d < dim; ++d) sq += widen(x[d]) * widen(x[d]);
  const float r = 1.f / std::sqrt(sq / float(dim) + eps);
  d = 0;
#ifdef __AVX2__
  for (const __m256 rv = _mm256_set1_ps(r); d + 8 <= dim; d += 8)
    store8(_mm256_mul_ps(load8(weight + d), round8<T>(_mm256_mul_ps(load8(x + d), rv))), out + d);
#endif
  for (; d < dim; ++d) store(widen(weight[d]) * widen(round_to<T>(widen(x[d]) * r)), out + d);
}

// residual = round(x + residual) (x alone in the first layer), then out = its norm; one row.
template <typename T>
void add_and_norm_row(const T* x, const T* residual, const T* weight, float eps, T* residual_out, T* out,
                      int64_t dim) {
  int64_t d = 0;
#ifdef __AVX2__
  for (; residual && d + 8 <= dim; d += 8) store8(_mm256_add_ps(load8(x + d), load8(residual + d)), residual_out + d);
#endif
  for (; d < dim; ++d) residual_out[d] = residual ? round_to<T>(widen(x[d]) + widen(residual[d])) : x[d];
  rms_norm_row(residual_out, weight, eps, out, dim);
}

// act = round(round(silu(gate)) * up) for one row of [gate | up], silu(g) = g / (1 + e^-g) as torch computes it.
template <typename T>
void silu_and_mul_row(const T* gate_up, T* act, int64_t I) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 16 <= I; i += 16) {
    const __m512 g = load16(gate_up + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    store16(_mm512_mul_ps(silu, load16(gate_up + I + i)), act + i);
  }
#endif
#ifdef __AVX2__
  for (; i + 8 <= I; i += 8) {
    const __m256 g = load8(gate_up + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = round8<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    store8(_mm256_mul_ps(silu, load8(gate_up + I + i)), act + i);
  }
#endif
  for (; i < I; ++i) {
    const float g = widen(gate_up[i]);
    act[i] = round_to<T>(widen(round_to<T>(g / (1.f + std::exp(-g)))) * widen(gate_up[I + i]));
  }
}

// Rotate-half rotary embedding of `count` heads in place, each product and the sum rounded as torch's ops do.
template <typename T>
void rotate(T* heads, int64_t count, int64_t dim, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < count; ++h) {
    T* x = heads + h * dim;
    int64_t d = 0;
#ifdef __AVX2__
    for (; d + 8 <= half; d += 8) {
      const __m256 a = load8(x + d), b = load8(x + d + half);
      const __m256 c0 = round8<T>(_mm256_loadu_ps(cos + d)), s0 = round8<T>(_mm256_loadu_ps(sin + d));
      const __m256 c1 = round8<T>(_mm256_loadu_ps(cos + d + half)), s1 = round8<T>(_mm256_loadu_ps(sin + d + half));
      const __m256 minus_b = _mm256_sub_ps(_mm256_setzero_ps(), b);
      store8(_mm256_add_ps(round8<T>(_mm256_mul_ps(a, c0)), round8<T>(_mm256_mul_ps(minus_b, s0))), x + d);
      store8(_mm256_add_ps(round8<T>(_mm256_mul_ps(b, c1)), round8<T>(_mm256_mul_ps(a, s1))), x + d + half);
    }
#endif
    for (; d < half; ++d) {
      const float a = widen(x[d]), b = widen(x[d + half]);
      const float c0 = widen(round_to<T>(cos[d])), s0 = widen(round_to<T>(sin[d]));
      const float c1 = widen(round_to<T>(cos[d + half])), s1 = widen(round_to<T>(sin[d + half]));
      store(widen(round_to<T>(a * c0)) + widen(round_to<T>(-b * s0)), x + d);
      store(widen(round_to<T>(b * c1)) + widen(round_to<T>(a * s1)), x + d + half);
    }
  }
}

// The elementwise steps between the products go over the threads from this many elements on: below it, waking
// them costs more than the work (a few microseconds a region; a layer has several).
constexpr int64_t kParallelMinElements = 1 << 14;

// Rows of add_and_norm_row, over the threads for many; in place is fine.
template <typename T>
void add_and_norm_rows(const T* x, const T* residual, const T* weight, float eps, T* residual_out, T* out, int64_t M,
                       int64_t H) {
#pragma omp parallel for if (M * H >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m)
    add_and_norm_row(x + m * H, residual ? residual + m * H : nullptr, weight, eps, residual_out + m * H, out + m * H,
                     H);
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, T* act, int64_t M, int64_t I) {
#pragma omp parallel for if (M * I >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m) silu_and_mul_row(gate_up + m * 2 * I, act + m * I, I);
}

// Each of `count` heads of `dim` in place: its RMSNorm with `weight`, or nothing for a null weight.
template <typename T>
void norm_heads(T* heads, int64_t count, int64_t dim, const T* weight, float eps) {
  if (weight)
    for (int64_t h = 0; h < count; ++h) rms_norm_row(heads + h * dim, weight, eps, heads + h * dim, dim);
}

// The attention between the layer's qkv and o products: q/k norms where the layer has them, then rotary on q and k
// of qkv [M, q + 2 kv] (in place), the step's K/V written into the caches [blocks, kv_heads, block_size, head_dim]
// (a negative slot writes none), and each row's attention over its sequence into attn [M, q].
template <typename T>
void attend(const DecoderLayer<T>& L, T* qkv, const int64_t* positions, const int64_t* slots, T* k_cache, T* v_cache,
            int64_t block_size, const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, T* attn,
            int64_t M) {
  const int64_t D = L.head_dim, q_size = L.heads * D, kv_size = L.kv_heads * D, qkv_size = q_size + 2 * kv_size;
  std::vector<T> q(M * q_size);
#pragma omp parallel for if (M * qkv_size >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m) {
    T* row = qkv + m * qkv_size;
    const float *cos = L.cos + positions[m] * D, *sin = L.sin + positions[m] * D;
    norm_heads(row, L.heads, D, L.q_norm, L.eps);
    norm_heads(row + q_size, L.kv_heads, D, L.k_norm, L.eps);
    rotate(row, L.heads, D, cos, sin);
    rotate(row + q_size, L.kv_heads, D, cos, sin);
    std::copy(row, row + q_size, q.data() + m * q_size);
    if (slots[m] < 0) continue;
    const int64_t block = slots[m] / block_size, offset = slots[m] % block_size;
    for (int64_t h = 0; h < L.kv_heads; ++h) {
      const int64_t at = ((block * L.kv_heads + h) * block_size + offset) * D;
      std::copy(row + q_size + h * D, row + q_size + (h + 1) * D, k_cache + at);
      std::copy(row + q_size + kv_size + h * D, row + q_size + kv_size + (h + 1) * D, v_cache + at);
    }
  }
  decode_any<T>(q.data(), k_cache, v_cache, tables, seq_lens, attn, M, L.heads, L.kv_heads, block_size, D, max_blocks,
                L.scale, 0.f, L.window);
}

// x [M, hidden] (this layer's input), residual [M, hidden] or null (first layer); writes out [M, hidden] and
// residual_out [M, hidden] (either may be x or residual: each is read before it is written).
template <typename T>
void decoder_layer(const DecoderLayer<T>& L, const T* x, const T* residual, T* out, T* residual_out,
                   const int64_t* positions, const int64_t* slots, T* k_cache, T* v_cache, int64_t block_size,
                   const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, int64_t M) {
  const int64_t H = L.hidden, q_size = L.heads * L.head_dim, qkv_size = q_size + 2 * L.kv_heads * L.head_dim;
  const int64_t I = L.intermediate;
  std::vector<T> normed(M * H), qkv(M * qkv_size), attn(M * q_size);
  add_and_norm_rows(x, residual, L.input_norm, L.eps, residual_out, normed.data(), M, H);
  project(L.qkv, normed.data(), L.qkv_bias, qkv.data(), M, qkv_size, H);
  attend(L, qkv.data(), positions, slots, k_cache, v_cache, block_size, tables, max_blocks, seq_lens, attn.data(), M);
  std::vector<T> o(M * H), gate_up(M * 2 * I), act(M * I);
  project(L.o, attn.data(), L.o_bias, o.data(), M, H, q_size);
  add_and_norm_rows(o.data(), residual_out, L.post_norm, L.eps, residual_out, normed.data(), M, H);
  project(L.gate_up, normed.data(), static_cast<const T*>(nullptr), gate_up.data(), M, 2 * I, H);
  silu_and_mul_rows(gate_up.data(), act.data(), M, I);
  project(L.down, act.data(), static_cast<const T*>(nullptr), out, M, H, I);
}

// A stage's layers in order, the hidden states and residual carried in out and residual_out (x and residual are
// only read; residual null before the first layer), then the final norm if final_norm is set: out = its norm,
// residual_out = the last sum. One cache pair per layer.
template <typename T>
void stage_layers(const std::vector<DecoderLayer<T>>& layers, const std::vector<T*>& k_caches,
                  const std::vector<T*>& v_caches, const T* final_norm, float final_eps, const T* x, const T* residual,
                  T* out, T* residual_out, const int64_t* positions, const int64_t* slots, int64_t block_size,
                  const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, int64_t M) {
  for (size_t i = 0; i < layers.size(); ++i)
    decoder_layer(layers[i], i ? out : x, i ? residual_out : residual, out, residual_out, positions, slots,
                  k_caches[i], v_caches[i], block_size, tables, max_blocks, seq_lens, M);
  if (final_norm)
    add_and_norm_rows(out, residual_out, final_norm, final_eps, residual_out, out, M, layers.front().hidden);
}

}  // namespace pagedserve
