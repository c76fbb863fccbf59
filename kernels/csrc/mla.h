// Multi-head latent attention (DeepSeek-V2/V3) absorbed, for decodes and short chunks alike: what
// workers/layers/mla.py's absorbed path computes, with the same roundings to the model dtype.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

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

// Each head's [M, in] slice of x (rows of x_stride, the head's at x + h * x_at) through w [heads, N, in] into y's
// [M, N] slice (rows of y_stride, at y + h * y_at); from each head's pairs copy where given. The heads share out
// the threads, each head's product on one (the product's own parallel loop then runs nested, alone): one parallel
// region for all of them, not one per head.
template <typename T>
void per_head_products(const T* x, int64_t x_stride, int64_t x_at, const T* w, const uint16_t* pairs, T* y,
                       int64_t y_stride, int64_t y_at, int64_t heads, int64_t M, int64_t N, int64_t K) {
  [[maybe_unused]] const int64_t pairs_elems = (N + 31) / 32 * ((K + 1) / 2) * 64;  // one head's pair_weight copy
#pragma omp parallel if (heads > 1)
  {
    std::vector<T> in(M * K), out(M * N);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t m = 0; m < M; ++m) std::copy_n(x + m * x_stride + h * x_at, K, in.data() + m * K);
      bool paired = false;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<T, uint16_t>)
        if ((paired = pairs != nullptr))
          gemv_pairs_bf16(in.data(), pairs + h * pairs_elems, nullptr, out.data(), M, N, K);
#endif
      if (!paired) gemv(in.data(), w + h * N * K, static_cast<const T*>(nullptr), out.data(), M, N, K);
      for (int64_t m = 0; m < M; ++m) std::copy_n(out.data() + m * N, N, y + m * y_stride + h * y_at);
    }
  }
}

// q [M, heads * (nope + rope)] and kv [M, lora + rope] (rows of q_stride and kv_stride; kv rotated in place): the
// latent rows [kv_norm(c) | rope(k_pe)] written to the cache (a negative slot writes none), each head's query
// [W_UK^T q_nope | rope(q_pe)] attending over them (one KV head), the first lora dims of each head's output
// through W_UV into attn [M, heads * v]. cos, sin: [max_position, rope].
template <typename T>
void mla_attend(const Mla<T>& A, int64_t heads, const float* cos_table, const float* sin_table, float scale,
                const T* q, int64_t q_stride, T* kv, int64_t kv_stride, const int64_t* positions, const int64_t* slots,
                const KvCache& cache, int64_t block_size, const int64_t* tables, int64_t max_blocks,
                const int64_t* seq_lens, T* attn, int64_t M) {
  const int64_t L = A.lora, R = A.rope, D = L + R, qk = A.nope + R;
  const Norm<T> kv_norm{kRmsNorm, A.kv_norm, nullptr, A.eps};
  std::vector<T> query(M * heads * D), out(M * heads * D);
#pragma omp parallel for if (M * heads * D >= kParallelMinElements)
  for (int64_t m = 0; m < M; ++m) {
    const float *cos = cos_table + positions[m] * R, *sin = sin_table + positions[m] * R;
    T* row = kv + m * kv_stride;
    std::vector<T> pe(R);
    norm_row(kv_norm, row, row, L);
    evens_first(row + L, pe.data(), R);
    rotate(pe.data(), R, cos, sin);
    std::copy_n(pe.data(), R, row + L);
    for (int64_t h = 0; h < heads; ++h) {
      T* to = query.data() + (m * heads + h) * D + L;
      evens_first(q + m * q_stride + h * qk + A.nope, to, R);
      rotate(to, R, cos, sin);
    }
    if (slots[m] < 0) continue;
    const int64_t block = slots[m] / block_size, offset = slots[m] % block_size;
    std::copy_n(row, D, static_cast<T*>(cache.k) + (block * block_size + offset) * D);
  }
  per_head_products(q, q_stride, qk, A.w_uk_t, A.w_uk_pairs, query.data(), heads * D, D, heads, M, L, A.nope);
  KvCache latent = cache;  // one row per token, key and value: the cache's key half (the op path binds both to it)
  latent.v = cache.k;
  decode_any<T>(query.data(), latent, tables, seq_lens, out.data(), M, heads, 1, block_size, D, max_blocks, scale, 0.f,
                0);
  per_head_products(out.data(), heads * D, D, A.w_uv, A.w_uv_pairs, attn, heads * A.v, A.v, heads, M, A.v, L);
}

}  // namespace pagedserve
