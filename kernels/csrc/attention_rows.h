// The decode attention's row kernels: query . key rows and probability-weighted value rows, over float32 rows (a
// block widened once) or, on AVX-512 BF16 CPUs, bf16 rows read as stored.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common.h"
#include "kv_cache.h"

namespace pagedserve {

// float32 rows are used in place; bf16 rows (on CPUs without AVX-512 BF16, or head sizes other than multiples of 32)
// are widened once into `buf` and then reused by every query head.
inline const float* widen_rows(const float* src, float*, int64_t) { return src; }
inline const float* widen_rows(const uint16_t* src, float* buf, int64_t count) {
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(buf + i, load8(src + i));
#endif
  for (; i < count; ++i) buf[i] = widen(src[i]);
  return buf;
}
// fp8 rows as widen_fp8_rows gives them (the caller folds in kFp8Unit and the scales).
template <typename C, typename = std::enable_if_t<kIsFp8<C>>>
inline const float* widen_rows(const C* src, float* buf, int64_t count) { return widen_fp8_rows(src, buf, count); }

// The native bf16 path's rows: a bf16 cache's in place, an fp8 cache's converted into buf (bf16_fp8_rows).
inline const uint16_t* bf16_rows(const uint16_t* src, uint16_t*, int64_t) { return src; }
template <typename C, typename = std::enable_if_t<kIsFp8<C>>>
inline const uint16_t* bf16_rows(const C* src, uint16_t* buf, int64_t count) { return bf16_fp8_rows(src, buf, count); }

// out[i] = q . k_i for `count` consecutive rows k_i of dim floats. With D fixed (a multiple of 8), four rows at a
// time, two accumulators each from 64 dims on, so that the FMA chains overlap; one shuffle tree sums the four.
template <int D>
inline void dot_rows(const float* __restrict q, const float* __restrict k, int64_t count, int64_t dim,
                     float* __restrict out) {
  int64_t i = 0;
#ifdef __AVX2__
  if constexpr (D > 0 && D % 8 == 0) {
    constexpr int A = D >= 64 ? 2 : 1;
    for (; i + 4 <= count; i += 4) {
      __m256 acc[4][A];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r)
#pragma GCC unroll 2
        for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r)
          acc[r][(d / 8) % A] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (i + r) * D + d), acc[r][(d / 8) % A]);
      }
      __m256 sums[4];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) sums[r] = A == 2 ? _mm256_add_ps(acc[r][0], acc[r][A - 1]) : acc[r][0];
      const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(sums[0], sums[1]), _mm256_hadd_ps(sums[2], sums[3]));
      _mm_storeu_ps(out + i, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    }
  }
#endif
  for (; i < count; ++i) {
    const float* __restrict row = k + i * dim;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < (D ? D : dim); ++d) dot += q[d] * row[d];
    out[i] = dot;
  }
}

// acc += sum_i p[i] * v_i over `count` consecutive rows v_i of dim floats. With D fixed (a multiple of 8), acc stays
// in registers over the rows, up to 64 dims per pass.
template <int D>
inline void accumulate_rows(const float* __restrict p, const float* __restrict v, int64_t count, int64_t dim,
                            float* __restrict acc) {
#ifdef __AVX2__
  if constexpr (D > 0 && D % 8 == 0) {
    constexpr int C = D < 64 ? D / 8 : 8;
    for (int d0 = 0; d0 < D; d0 += C * 8) {
      __m256 a[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(acc + d0 + c * 8);
      for (int64_t i = 0; i < count; ++i) {
        const __m256 pv = _mm256_broadcast_ss(p + i);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i * D + d0 + c * 8), a[c]);
      }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + d0 + c * 8, a[c]);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) {
    const float* __restrict row = v + i * dim;
#pragma omp simd
    for (int64_t d = 0; d < (D ? D : dim); ++d) acc[d] += p[i] * row[d];
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The bf16 cache read as stored: vdpbf16ps multiplies query and key pairs exactly into float32 sums (scaled after),
// and value rows widen in registers; no float32 copy of a block is written and read back.
constexpr bool kNativeBf16Attention = true;

// out[i] = scale * (q . k_i) for `count` consecutive bf16 rows k_i of D dims (a multiple of 32; D == 0: dim, a
// multiple of 32 known at run time, the query's chunks then read from memory), 16 at a time with their sums added
// across lanes together.
template <int D>
inline void score_rows_bf16(const uint16_t* __restrict q, const uint16_t* __restrict k, int64_t count, float scale,
                            float* __restrict out, int64_t dim = D) {
  constexpr int kept = D > 0 ? D / 32 : 1;
  __m512bh qv[kept];
  if constexpr (D > 0)
    for (int c = 0; c < D / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
  for (int64_t i = 0; i < count; i += 16) {
    const int64_t n = std::min<int64_t>(16, count - i);
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      acc[r] = _mm512_setzero_ps();
      if (r >= n) continue;
      if constexpr (D > 0) {
#pragma GCC unroll 4
        for (int c = 0; c < D / 32; ++c)
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(k + (i + r) * D + c * 32), qv[c]);
      } else {
        for (int64_t c = 0; c < dim; c += 32)
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(k + (i + r) * dim + c),
                                    (__m512bh)_mm512_loadu_si512(q + c));
      }
    }
    _mm512_mask_storeu_ps(out + i, __mmask16((1u << n) - 1), _mm512_mul_ps(sum_lanes_16(acc), _mm512_set1_ps(scale)));
  }
}

// acc[g] += sum_i p[g][i] * v_i for NG queries at once over `count` consecutive bf16 rows v_i of D dims (a multiple
// of 16), the accumulators in registers: each V row widened once for all of them, and their sums independent chains
// (one query's chain alone waits on each FMA's latency). Each query's sum runs over i in order, as alone. Rows of
// v are v_stride apart (D: whole rows; more: a slice of D dims of each).
template <int D, int NG>
inline void accumulate_heads_bf16(const float* __restrict p, int64_t p_stride, const uint16_t* __restrict v,
                                  int64_t count, float* __restrict acc, int64_t acc_stride, int64_t v_stride = D) {
  constexpr int C = D / 16;
  __m512 a[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * acc_stride + c * 16);
  for (int64_t i = 0; i < count; ++i) {
    __m512 w[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i * v_stride + c * 16));
      w[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      const __m512 pv = _mm512_set1_ps(p[g * p_stride + i]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pv, w[c], a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * acc_stride + c * 16, a[g][c]);
}

// accumulate_heads_bf16 for the G query heads of one KV head (probabilities p_stride apart, accumulators D apart),
// as many at once as 16 accumulator registers hold; D == 0: rows of dim (a multiple of 32 known at run time), taken
// in slices of 64 dims (the last maybe 32), four heads at once.
template <int D>
inline void accumulate_group_bf16(const float* p, int64_t p_stride, const uint16_t* v, int64_t count, float* acc,
                                  int64_t G, int64_t dim = D) {
  constexpr int most = D <= 64 ? 4 : D <= 128 ? 2 : 1;
  for (int64_t g = 0; g < G; g += most) {
    const float* pg = p + g * p_stride;
    float* ag = acc + g * dim;
    if constexpr (D == 0) {
      for (int64_t s = 0; s < dim; s += 64) {
        auto slice = [&](auto heads) {
          constexpr int NG = decltype(heads)::value;
          if (dim - s >= 64) accumulate_heads_bf16<64, NG>(pg, p_stride, v + s, count, ag + s, dim, dim);
          else accumulate_heads_bf16<32, NG>(pg, p_stride, v + s, count, ag + s, dim, dim);
        };
        switch (std::min<int64_t>(most, G - g)) {
          case 4: slice(std::integral_constant<int, 4>{}); break;
          case 3: slice(std::integral_constant<int, 3>{}); break;
          case 2: slice(std::integral_constant<int, 2>{}); break;
          default: slice(std::integral_constant<int, 1>{}); break;
        }
      }
      continue;
    }
    switch (std::min<int64_t>(most, G - g)) {
      case 4: if constexpr (most >= 4) accumulate_heads_bf16<D, 4>(pg, p_stride, v, count, ag, D); break;
      case 3: if constexpr (most >= 3) accumulate_heads_bf16<D, 3>(pg, p_stride, v, count, ag, D); break;
      case 2: if constexpr (most >= 2) accumulate_heads_bf16<D, 2>(pg, p_stride, v, count, ag, D); break;
      default: accumulate_heads_bf16<D, 1>(pg, p_stride, v, count, ag, D); break;
    }
  }
}
#else
constexpr bool kNativeBf16Attention = false;
template <int D>
inline void score_rows_bf16(const uint16_t*, const uint16_t*, int64_t, float, float*, int64_t = D) {}
template <int D>
inline void accumulate_group_bf16(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t = D) {}
#endif

}  // namespace pagedserve
