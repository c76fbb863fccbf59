// Fused paged-attention decode: each K and V row read once, in place, from the paged cache.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

namespace pagedserve {

// float32 rows are used in place; bf16 rows are widened once into `buf` and then reused by every query head.
template <int D, typename T>
inline const float* load_row(const T* __restrict src, float* __restrict buf, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t d = 0; d < (D ? D : dim); ++d) buf[d] = widen(src[d]);
    return buf;
  }
}

// The hardware prefetcher stops at the scattered block boundaries: request the next block while on this one.
template <typename T>
inline void prefetch(const T* block, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(block);
  for (int64_t off = 0; off < elems * int64_t(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

// fn(j, row) for each context position j in [start, len) of KV head h, the row as float32, in block order.
template <int D, typename T, typename Fn>
inline void for_each_row(const T* cache, const int64_t* table, int64_t h, int64_t kv_heads, int64_t bs, int64_t dim,
                         int64_t start, int64_t len, float* buf, Fn fn) {
  for (int64_t b = start / bs; b * bs < len; ++b) {
    const int64_t j0 = std::max(start, b * bs), j1 = std::min(len, (b + 1) * bs);
    const T* block = cache + (table[b] * kv_heads + h) * bs * dim;
    if ((b + 1) * bs < len) prefetch(cache + (table[b + 1] * kv_heads + h) * bs * dim, bs * dim);
    for (int64_t j = j0; j < j1; ++j) fn(j, load_row<D>(block + (j - b * bs) * dim, buf, dim));
  }
}

// D > 0 fixes head_dim at compile time so the inner loops fully unroll; D == 0 handles any head_dim.
// soft_cap > 0: scores become soft_cap * tanh(score / soft_cap) before the softmax (Gemma 2).
template <typename T, int D>
void decode(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
            int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t bs, int64_t head_dim,
            int64_t max_blocks, float scale, float soft_cap, int64_t window, int64_t max_len) {
  const int64_t dim = D ? D : head_dim, G = num_heads / kv_heads;
#pragma omp parallel
  {
    // Two passes over keys (scores, then V) with the scores kept here: each K and V row is read exactly once.
    std::vector<float> scores(G * std::max<int64_t>(max_len, 1)), qf(G * dim), acc(G * dim), row(dim), inv(G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < num_seqs * kv_heads; ++pair) {
      const int64_t s = pair / kv_heads, h = pair % kv_heads, len = lens[s];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - start;
      const int64_t* table = tables + s * max_blocks;
      T* o = out + (s * num_heads + h * G) * dim;
      if (n <= 0) {
        for (int64_t i = 0; i < G * dim; ++i) store(0.f, o + i);
        continue;
      }
      const T* qs = q + (s * num_heads + h * G) * dim;
      for (int64_t i = 0; i < G * dim; ++i) qf[i] = widen(qs[i]) * scale;

      for_each_row<D>(kc, table, h, kv_heads, bs, dim, start, len, row.data(), [&](int64_t j, const float* k) {
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict qg = qf.data() + g * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qg[d] * k[d];
          scores[g * n + j - start] = dot;
        }
      });

      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * n;
        if (soft_cap > 0.f)
          for (int64_t i = 0; i < n; ++i) sc[i] = soft_cap * std::tanh(sc[i] / soft_cap);
        const float m = *std::max_element(sc, sc + n);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) sum += (sc[i] = std::exp(sc[i] - m));
        inv[g] = 1.f / sum;
      }

      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row<D>(vc, table, h, kv_heads, bs, dim, start, len, row.data(), [&](int64_t j, const float* v) {
        for (int64_t g = 0; g < G; ++g) {
          float* __restrict a = acc.data() + g * dim;
          const float p = scores[g * n + j - start];
          for (int64_t d = 0; d < dim; ++d) a[d] += p * v[d];
        }
      });
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < dim; ++d) store(acc[g * dim + d] * inv[g], o + g * dim + d);
    }
  }
}

}  // namespace pagedserve
