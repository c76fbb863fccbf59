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

#include "attention_amx.h"
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

// V3's q_b product joined to the heads' region: each piece's q rows of its heads from q_a [M, q_lora] (normed) by
// q_b's pairs copy into q, where a head's q rows fill whole tiles of the copy; pairs null: q is given.
template <typename T>
struct QueryProduct {
  const T* q_a = nullptr;
  const uint16_t* pairs = nullptr;
  T* q = nullptr;
};

// Whether the heads' region can compute q as `from` describes (every head's q rows whole tiles of the copy).
template <typename T>
bool joins_query(const Mla<T>& A) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return std::is_same_v<T, uint16_t> && A.q_lora && (A.nope + A.rope) % kPairTileRows == 0;
#else
  return false;
#endif
}

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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// acc [NG, 32] += sum_i p[g][i] * v_i over count bf16 rows v_i (of stride D) for NG heads at once: each 32 dims
// widened once for all heads, the even and the odd dims apart (a shift and a mask, no shuffle), so acc holds a
// chunk's even dims, then its odd ones. Each sum over i in order, as decode_attention.h's accumulate_heads_bf16.
template <int NG>
inline void latent_values(const float* p, int64_t p_stride, const uint16_t* v, int64_t D, int64_t count, float* acc) {
  __m512 a[NG][2];
  for (int g = 0; g < NG; ++g) a[g][0] = _mm512_loadu_ps(acc + g * 32), a[g][1] = _mm512_loadu_ps(acc + g * 32 + 16);
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t i = 0; i < count; ++i) {
    const __m512i row = _mm512_loadu_si512(v + i * D);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(row, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(row, high));
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      const __m512 pv = _mm512_set1_ps(p[g * p_stride + i]);
      a[g][0] = _mm512_fmadd_ps(pv, even, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(pv, odd, a[g][1]);
    }
  }
  for (int g = 0; g < NG; ++g) _mm512_storeu_ps(acc + g * 32, a[g][0]), _mm512_storeu_ps(acc + g * 32 + 16, a[g][1]);
}

// The attention of query [rows, nh, D] over one bf16 latent KV head (rows of D = L + rope, values its first L dims;
// L and D multiples of 32) into got [rows, nh, D] (its first L dims of each head): decode_attention.h's decode()
// with the same scores, softmax and sums, but only the value dims W_UV reads, 32 of them of a row widened once for
// eight heads. Each row attends to its own sequence (a short chunk's rows read their shared rows from cache).
// amx: the scores as tile products of a block's rows and the row's nh queries (attention_amx.h; the model's heads
// decide it, not nh, so that a head's scores do not depend on how the heads were split over threads).
inline void latent_attention(const uint16_t* query, const uint16_t* cache, const int64_t* tables, int64_t max_blocks,
                             const int64_t* seq_lens, uint16_t* got, int64_t rows, int64_t nh, int64_t bs, int64_t L,
                             int64_t D, float scale, bool amx) {
  std::vector<float> scores, acc(nh * L), inv(nh);
  AmxScores tiles(amx ? D : 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = seq_lens[r], *table = tables + r * max_blocks;
    scores.resize(nh * std::max<int64_t>(n, 1));
    std::fill(acc.begin(), acc.end(), 0.f);
    if (amx)
      tiles.set_queries(nh, [&](int64_t g) { return query + (r * nh + g) * D; }, scores.data(), n, scale);
    for_each_block(cache, table, 0, 1, bs, D, 0, n, {cache}, [&](int64_t j0, int64_t j1, const uint16_t* k) {
      if (amx) return tiles.add(k, j1 - j0, j0);
      for (int64_t g = 0; g < nh; ++g)
        score_rows_bf16<0>(query + (r * nh + g) * D, k, j1 - j0, scale, scores.data() + g * n + j0, D);
    });
    tiles.flush();
    for (int64_t g = 0; g < nh; ++g) inv[g] = n ? 1.f / exp_sum(&scores[g * n], n, max_of(&scores[g * n], n)) : 0.f;
    for_each_block(cache, table, 0, 1, bs, D, 0, n, {}, [&](int64_t j0, int64_t j1, const uint16_t* v) {
      for (int64_t g = 0; g < nh; g += 8)
        for (int64_t c = 0; c < L; c += 32) {
          const float* p = scores.data() + g * n + j0;
          float* a = acc.data() + g * L + c * std::min<int64_t>(8, nh - g);
          auto heads = [&](auto ng) { latent_values<decltype(ng)::value>(p, n, v + c, D, j1 - j0, a); };
          switch (std::min<int64_t>(8, nh - g)) {
            case 8: heads(std::integral_constant<int, 8>{}); break;
            case 7: heads(std::integral_constant<int, 7>{}); break;
            case 6: heads(std::integral_constant<int, 6>{}); break;
            case 5: heads(std::integral_constant<int, 5>{}); break;
            case 4: heads(std::integral_constant<int, 4>{}); break;
            case 3: heads(std::integral_constant<int, 3>{}); break;
            case 2: heads(std::integral_constant<int, 2>{}); break;
            default: heads(std::integral_constant<int, 1>{}); break;
          }
        }
    });
    // acc of heads g..g+ng, chunk c: [ng][even 16 | odd 16] at g * L + c * ng.
    for (int64_t g0 = 0; g0 < nh; g0 += 8) {
      const int64_t ng = std::min<int64_t>(8, nh - g0);
      for (int64_t g = g0; g < g0 + ng; ++g)
        for (int64_t c = 0; c < L; c += 32) {
          const float* a = acc.data() + g0 * L + c * ng + (g - g0) * 32;
          uint16_t* o = got + (r * nh + g) * D + c;
          for (int64_t d = 0; d < 16; ++d) store(a[d] * inv[g], o + 2 * d), store(a[16 + d] * inv[g], o + 2 * d + 1);
        }
    }
  }
}
#endif

// The rows [r0, r0 + rows) and heads [h0, h0 + nh) of mla_attend's work after the latent rows are cached, on this
// thread: each head's query [W_UK^T q_nope | rope(q_pe)], its attention over the latent rows, W_UV of its output.
template <typename T>
void mla_heads(const Mla<T>& A, int64_t heads, const float* cos_table, const float* sin_table, float scale,
               const T* q, int64_t q_stride, const int64_t* positions, const KvCache& latent, int64_t block_size,
               const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, T* attn, int64_t r0, int64_t rows,
               int64_t h0, int64_t nh, const QueryProduct<T>& from) {
  const int64_t L = A.lora, R = A.rope, D = L + R, qk = A.nope + R;
  std::vector<T> in(rows * std::max(A.nope, L)), out(rows * std::max(L, A.v)), query(rows * nh * D), got(rows * nh * D);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if (from.pairs) {  // this piece's rows and heads of q: as gemv_pairs computes each output, whatever the tiling
      const int64_t K = A.q_lora, elems = (K + 1) / 2 * 2 * kPairTileRows;
      for (int64_t t = h0 * qk / kPairTileRows; t < (h0 + nh) * qk / kPairTileRows; ++t)
        for (int64_t m0 = 0; m0 < rows; m0 += kPairGroupRows)
          pair_group(from.pairs + t * elems, from.q_a + r0 * K, nullptr, from.q + r0 * q_stride, t * kPairTileRows,
                     m0, std::min(kPairGroupRows, rows - m0), q_stride, K);
    }
#endif
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
  bool native = false;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if ((native = latent.kind == kCacheModelDtype && L % 32 == 0 && D % 32 == 0))
      latent_attention(query.data(), static_cast<const T*>(latent.k), tables + r0 * max_blocks, max_blocks,
                       seq_lens + r0, got.data(), rows, nh, block_size, L, D, scale, heads >= 8 && amx_usable());
#endif
  if (!native)
    decode_any<T>(query.data(), latent, tables + r0 * max_blocks, seq_lens + r0, got.data(), rows, nh, 1,
                  block_size, D, max_blocks, scale, 0.f, 0);
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
                const int64_t* seq_lens, T* attn, int64_t M, const QueryProduct<T>& from = {}) {
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
  // Pieces of up to a pair group's rows (the heads' products read each weight tile once per piece), cut evenly
  // whatever the thread count and the rows' order: a product of one row rounds differently from one of several
  // (gemv.h's paths by row count), so a row must never sit alone in a piece but in a step of one row. Pieces sized by
  // the threads made a row's output follow the thread count (which the engine changes beside a busy neighbour), and
  // a remainder of one row its place in the step. Threads beyond the pieces split the heads, which computes every
  // head alike.
  constexpr int64_t most_rows = 8;
  if (M == 0) return;
  const int64_t pieces = (M + most_rows - 1) / most_rows;
  const int64_t head_parts = std::clamp<int64_t>(threads / pieces, 1, heads);
#pragma omp parallel for schedule(dynamic) if (pieces * head_parts > 1)
  for (int64_t item = 0; item < pieces * head_parts; ++item) {
    const int64_t piece = item / head_parts, part = item % head_parts;
    const int64_t r0 = M * piece / pieces, r1 = M * (piece + 1) / pieces;
    const int64_t h0 = heads * part / head_parts, h1 = heads * (part + 1) / head_parts;
    mla_heads(A, heads, cos_table, sin_table, scale, q, q_stride, positions, latent, block_size, tables, max_blocks,
              seq_lens, attn, r0, r1 - r0, h0, h1 - h0, from);
  }
}

}  // namespace pagedserve
