// The decode attention's row kernels: query . key rows and probability-weighted value rows, over float32 rows (a
// block widened once) or, on AVX-512 BF16 CPUs, bf16 rows read as stored.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
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

// The bf16 pairs (u[d], w[d]) of 32 dims of two rows as unpacklo / unpackhi_epi16 make them: out[m]'s pair j holds
// dim 8 (j / 4) + 4 m + j % 4 (fp8.h's pair tables give the same order).
struct Bf16RowPairs {
  void operator()(const uint16_t* u, const uint16_t* w, __m512i* out) const {
    const __m512i a = _mm512_loadu_si512(u), b = _mm512_loadu_si512(w);
    out[0] = _mm512_unpacklo_epi16(a, b), out[1] = _mm512_unpackhi_epi16(a, b);
  }
};
#ifdef __AVX512VBMI__
template <typename C>
struct Fp8RowPairs {  // fp8 rows' pairs straight from the byte tables, no bf16 copy of the block
  Fp8Bf16Lookup<C> lookup{384};
  void operator()(const C* u, const C* w, __m512i* out) const { fp8_bf16_pairs(u, w, lookup, out); }
};
#endif

// Probabilities as the V pass's bf16 (rounded to nearest even, as store() rounds the tail; none is NaN).
inline void bf16_probabilities(const float* p, uint16_t* out, int64_t count) {
  int64_t i = 0;
  for (; i + 32 <= count; i += 32)
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + i + 16), _mm512_loadu_ps(p + i)));
  for (; i < count; ++i) store(p[i], out + i);
}

// acc[g] += sum_i p[g][i] * v_i for NG queries at once over `count` consecutive rows v_i of D dims (a multiple of
// 32), two rows at a time: vdpbf16ps multiplies each (v_i[d], v_i+1[d]) pair by the probabilities (p[g][i],
// p[g][i+1]) as bf16 (as FlashAttention rounds P for its second product) into float32 sums, each V pair read once
// for all NG queries. acc holds dims in pair_slot order. Rows of v are v_stride apart (D: whole rows; more: a slice
// of D dims of each); an odd last row pairs with itself at probability 0.
template <int D, int NG, typename R, typename Pairs>
inline void accumulate_heads_bf16(const uint16_t* __restrict p, int64_t p_stride, const R* __restrict v,
                                  int64_t count, float* __restrict acc, int64_t acc_stride, int64_t v_stride,
                                  const Pairs& pairs) {
  constexpr int C = D / 16;
  __m512 a[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * acc_stride + c * 16);
  for (int64_t i = 0; i < count; i += 2) {
    const bool odd = i + 1 == count;
    __m512i w[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; c += 2) pairs(v + i * v_stride + c * 16, v + (i + !odd) * v_stride + c * 16, w + c);
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      uint32_t both = p[g * p_stride + i];
      if (!odd) std::memcpy(&both, p + g * p_stride + i, 4);
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(both));
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], (__m512bh)w[c], pv);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * acc_stride + c * 16, a[g][c]);
}

// accumulate_heads_bf16 for the G query heads of one KV head (bf16 probabilities p_stride apart, accumulators D
// apart), as many at once as 16 accumulator registers hold; D == 0: rows of dim (a multiple of 32 known at run
// time), taken in slices of 64 dims (the last maybe 32), four heads at once. Rows of type R read by `pairs`.
template <int D, typename R, typename Pairs>
inline void accumulate_group_bf16(const uint16_t* p, int64_t p_stride, const R* v, int64_t count, float* acc,
                                  int64_t G, int64_t dim, const Pairs& pairs) {
  constexpr int most = D <= 64 ? 4 : D <= 128 ? 2 : 1;
  for (int64_t g = 0; g < G; g += most) {
    const uint16_t* pg = p + g * p_stride;
    float* ag = acc + g * dim;
    auto heads = [&](auto ng) {
      constexpr int NG = decltype(ng)::value;
      if constexpr (D > 0) {
        if constexpr (NG <= most) accumulate_heads_bf16<D, NG>(pg, p_stride, v, count, ag, D, D, pairs);
      } else {
        for (int64_t s = 0; s < dim; s += 64) {
          if (dim - s >= 64) accumulate_heads_bf16<64, NG>(pg, p_stride, v + s, count, ag + s, dim, dim, pairs);
          else accumulate_heads_bf16<32, NG>(pg, p_stride, v + s, count, ag + s, dim, dim, pairs);
        }
      }
    };
    switch (std::min<int64_t>(most, G - g)) {
      case 4: heads(std::integral_constant<int, 4>{}); break;
      case 3: heads(std::integral_constant<int, 3>{}); break;
      case 2: heads(std::integral_constant<int, 2>{}); break;
      default: heads(std::integral_constant<int, 1>{}); break;
    }
  }
}
#else
constexpr bool kNativeBf16Attention = false;
template <int D>
inline void score_rows_bf16(const uint16_t*, const uint16_t*, int64_t, float, float*, int64_t = D) {}
struct Bf16RowPairs {};
inline void bf16_probabilities(const float*, uint16_t*, int64_t) {}
template <int D, typename R, typename Pairs>
inline void accumulate_group_bf16(const uint16_t*, int64_t, const R*, int64_t, float*, int64_t, int64_t,
                                  const Pairs&) {}
#endif

// The V pass's pair reader for cache rows of type C, and whether it reads them as stored (else a bf16 copy of each
// block: fp8 without VBMI).
template <typename C>
struct PairsOf {
  using type = Bf16RowPairs;
  static constexpr bool direct = std::is_same_v<C, uint16_t>;
};
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
template <>
struct PairsOf<Fp8E4m3> {
  using type = Fp8RowPairs<Fp8E4m3>;
  static constexpr bool direct = true;
};
template <>
struct PairsOf<Fp8E5m2> {
  using type = Fp8RowPairs<Fp8E5m2>;
  static constexpr bool direct = true;
};
#endif

// The slot of dim d in the accumulators of accumulate_heads_bf16 (pairs as unpacklo / unpackhi_epi16 make them).
inline int64_t pair_slot(int64_t d) {
  const int64_t e = d % 32;
  return d - e + 16 * ((e % 8) / 4) + 4 * (e / 8) + e % 4;
}

}  // namespace pagedserve
