// Multi-head latent attention (DeepSeek-V2/V3) absorbed, for decodes and short chunks alike: what
// workers/layers/mla.py's absorbed path computes, with the same roundings to the model dtype.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.h"
#include "decode_attention.h"
#include "gemv.h"
#include "gemv_pairs.h"
#include "kv_cache.h"
#include "layer_ops.h"

namespace pagedserve {

// The MLA form of a layer (lora == 0: none). The cache holds one row of lora + rope values per token, [c | k_pe],
// read as key and value by every head. w_uk_t: [heads, lora, nope] (each head's W_UK transposed), w_uv: [heads, v,
// lora]; q_a_norm (V3's q_a_layernorm, with q_lora > 0) and kv_norm are RMSNorms of eps. w_uk_pairs, w_uv_pairs:
// each head's gemv_pairs.h copy of its w_uk_t and w_uv in turn (bf16 on AVX-512 BF16), or null.
template <typename T>
struct Mla {
  const T *q_a_norm = nullptr, *kv_norm = nullptr, *w_uk_t = nullptr, *w_uv = nullptr;
  int64_t lora = 0, q_lora = 0, nope = 0, rope = 0, v = 0;
  float eps = 0.f;
  const uint16_t *w_uk_pairs = nullptr, *w_uv_pairs = nullptr;
};

// Dims d, then d + 1 of each pair: DeepSeek's adjacent-pair rotary as the rotate-half kernel computes it.
template <typename T>
inline void evens_first(const T* x, T* out, int64_t dim) {
  for (int64_t d = 0; d < dim / 2; ++d) out[d] = x[2 * d], out[dim / 2 + d] = x[2 * d + 1];
}

// y [M, N] = x [M, K] W^T on this thread (called from within the heads' region), from the head's pairs copy where
// given.
template <typename T>
void head_product(const T* x, const T* w, const uint16_t* pairs, T* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if (pairs) {
      const int64_t tiles = (N + kPairTileRows - 1) / kPairTileRows, tile_elems = (K + 1) / 2 * 2 * kPairTileRows;
      for (int64_t t = 0; t < tiles; ++t)
        for (int64_t m0 = 0; m0 < M; m0 += kPairGroupRows)
          pair_group(pairs + t * tile_elems, x, nullptr, y, t * kPairTileRows, m0, std::min(kPairGroupRows, M - m0),
                     N, K);
      return;
    }
#endif
  gemv(x, w, static_cast<const T*>(nullptr), y, M, N, K);  // nested: its parallel loop runs on this thread alone
}

// One head's pairs copy of a [N, K] weight: its offset from the previous head's.
inline int64_t head_pairs_elems(int64_t N, int64_t K) { return (N + 31) / 32 * ((K + 1) / 2) * 64; }

// The rows [r0, r0 + rows) and heads [h0, h0 + nh) of mla_attend's work after the latent rows are cached, on this
// thread: each head's query [W_UK^T q_nope | rope(q_pe)], its attention over the latent rows, W_UV of its output.
template <typename T>
void mla_heads(const Mla<T>& A, int64_t heads, const float* cos_table, const float* sin_table, float scale,
               const T* q, int64_t q_stride, const int64_t* positions, const KvCache& latent, int64_t block_size,
               const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, T* attn, int64_t r0, int64_t rows,
               int64_t h0, int64_t nh) {
  const int64_t L = A.lora, R = A.rope, D = L + R, qk = A.nope + R;
  std::vector<T> in(rows * std::max(A.nope, L)), out(rows * std::max(L, A.v)), query(rows * nh * D), got(rows * nh * D);
  for (int64_t i = 0; i < nh; ++i) {
    const int64_t h = h0 + i;
    for (int64_t r = 0; r < rows; ++r) std::copy_n(q + (r0 + r) * q_stride + h * qk, A.nope, in.data() + r * A.nope);
    head_product(in.data(), A.w_uk_t + h * L * A.nope, A.w_uk_pairs ? A.w_uk_pairs + h * head_pairs_elems(L, A.nope)
                 : nullptr, out.data(), rows, L, A.nope);
    for (int64_t r = 0; r < rows; ++r) {
      T* to = query.data() + (r * nh + i) * D;
      std::copy_n(out.data() + r * L, L, to);
      evens_first(q + (r0 + r) * q_stride + h * qk + A.nope, to + L, R);
      rotate(to + L, R, cos_table + positions[r0 + r] * R, sin_table + positions[r0 + r] * R);
    }
  }
  decode_any<T>(query.data(), latent, tables + r0 * max_blocks, seq_lens + r0, got.data(), rows, nh, 1, block_size,
                D, max_blocks, scale, 0.f, 0);
  for (int64_t i = 0; i < nh; ++i) {
    const int64_t h = h0 + i;
    for (int64_t r = 0; r < rows; ++r) std::copy_n(got.data() + (r * nh + i) * D, L, in.data() + r * L);
    head_product(in.data(), A.w_uv + h * A.v * L, A.w_uv_pairs ? A.w_uv_pairs + h * head_pairs_elems(A.v, L)
                 : nullptr, out.data(), rows, A.v, L);
    for (int64_t r = 0; r < rows; ++r) std::copy_n(out.data() + r * A.v, A.v, attn + (r0 + r) * heads * A.v + h * A.v);
  }
}

// q [M, heads * (nope + rope)] and kv [M, lora + rope] (rows of q_stride and kv_stride; kv rotated in place): the
// latent rows [kv_norm(c) | rope(k_pe)] written to the cache (a negative slot writes none), each head's query
// [W_UK^T q_nope | rope(q_pe)] attending over them (one KV head), the first lora dims of each head's output
// through W_UV into attn [M, heads * v]. cos, sin: [max_position, rope]. After the cache writes, one parallel region
// (not one per product and the attention between): pieces of up to a pair group's rows, and of the heads where
// there are fewer pieces than threads (a batch-1 step), each piece's products and attention on one thread.
template <typename T>
void mla_attend(const Mla<T>& A, int64_t heads, const float* cos_table, const float* sin_table, float scale,
                const T* q, int64_t q_stride, T* kv, int64_t kv_stride, const int64_t* positions, const int64_t* slots,
                const KvCache& cache, int64_t block_size, const int64_t* tables, int64_t max_blocks,
                const int64_t* seq_lens, T* attn, int64_t M) {
  const int64_t L = A.lora, R = A.rope, D = L + R;
  const Norm<T> kv_norm{kRmsNorm, A.kv_norm, nullptr, A.eps};
#pragma omp parallel for if (M * D >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m) {
    T* row = kv + m * kv_stride;
    std::vector<T> pe(R);
    norm_row(kv_norm, row, row, L);
    evens_first(row + L, pe.data(), R);
    rotate(pe.data(), R, cos_table + positions[m] * R, sin_table + positions[m] * R);
    std::copy_n(pe.data(), R, row + L);
    if (slots[m] < 0) continue;
    const int64_t block = slots[m] / block_size, offset = slots[m] % block_size;
    std::copy_n(row, D, static_cast<T*>(cache.k) + (block * block_size + offset) * D);
  }
  KvCache latent = cache;  // one row per token, key and value: the cache's key half (the op path binds both to it)
  latent.v = cache.k;
#ifdef _OPENMP
  const int64_t threads = omp_get_max_threads();
#else
  const int64_t threads = 1;
#endif
  constexpr int64_t most_rows = 8;  // a pair group's: the heads' products read each weight tile once per piece
  const int64_t piece = std::clamp<int64_t>((M + threads - 1) / threads, 1, most_rows);
  const int64_t pieces = (M + piece - 1) / piece, head_parts = std::clamp<int64_t>(threads / pieces, 1, heads);
#pragma omp parallel for schedule(dynamic) if (pieces * head_parts > 1)
  for (int64_t item = 0; item < pieces * head_parts; ++item) {
    const int64_t r0 = item / head_parts * piece, part = item % head_parts;
    const int64_t h0 = heads * part / head_parts, h1 = heads * (part + 1) / head_parts;
    mla_heads(A, heads, cos_table, sin_table, scale, q, q_stride, positions, latent, block_size, tables, max_blocks,
              seq_lens, attn, r0, std::min(piece, M - r0), h0, h1 - h0);
  }
}

}  // namespace pagedserve
