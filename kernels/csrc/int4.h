// 4-bit weights (kernels/quantized_matmul.py's storage: uint8 [N, K / 2], column 2j in the low nibble, a float32
// scale and optional zero point per row or per group of columns) in the C++ layer. Each element becomes
// (q - zero) * scale in float32 (zero 8 where none is given) rounded once to the dtype the op path's GEMM runs in
// (kernels.cpu_features.matmul_dtype: bf16 on CPUs with native bf16 products, else float32), as dequantize() makes
// the op path's weight, then multiplies as that dtype's weights do: bf16 rows against the weight's pairs copy by
// gemv_pairs.h's dot products (converted in registers per column pair at one row, per tile into a buffer at more),
// else a row dequantized at a time against every input row in float32 (any CPU).
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "gemv.h"
#include "pairs_converted.h"

namespace pagedserve {

template <typename T>
inline float as_weight(float value) {  // rounded as the op path's dequantized weight is
#if !(defined(__AVX512BF16__) || defined(__AMX_BF16__))
  if constexpr (std::is_same_v<T, uint16_t>) return value;  // its bf16 GEMMs run in float32 here
#endif
  T stored;
  store(value, &stored);
  return widen(stored);
}

// x [M, K], w uint8 [N, K / 2] with scale [N, K / group] and zero like scale (null: 8), bias [N] or null, y [M, N].
template <typename T>
void gemv_int4(const T* x, const uint8_t* w, const float* scale, const float* zero, int64_t group, const T* bias,
               T* y, int64_t M, int64_t N, int64_t K) {
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = widen(x[i]);
  const int64_t groups = K / group;
#pragma omp parallel
  {
    std::vector<float> row(K);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* bytes = w + n * (K / 2);
      for (int64_t g = 0; g < groups; ++g) {
        const float s = scale[n * groups + g], z = zero ? zero[n * groups + g] : 8.f;
        for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
          row[k] = as_weight<T>((float(bytes[k / 2] & 15) - z) * s);
          row[k + 1] = as_weight<T>((float(bytes[k / 2] >> 4) - z) * s);
        }
      }
      for (int64_t m = 0; m < M; ++m)
        store(dot(row.data(), xf.data() + m * K, K) + (bias ? widen(bias[n]) : 0.f), y + m * N + n);
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// One tile of 32 output rows of a 4-bit weight's pairs copy (kernels/cpu_int4.py's pair_int4): per column pair 32
// bytes, byte 16h + l holding lane l of the float32 vectors 2h (low nibble) and 2h + 1 (high nibble), vector v's
// lane l being row 8v + l / 2's column 2p + l % 2; then per group the 32 rows' scales and zero points.
struct Int4Tile {
  const uint8_t* nibbles;
  const float* scale;
  const float* zero;
  int64_t group_pairs;  // column pairs per group
};

// Column pair p of an Int4Tile as bf16 pairs (gemv_pairs.h's Bf16Pairs): rows 0..15 in w0, 16..31 in w1. A group's
// scales and zero points, each row's twice (its pair), are made once per group.
struct Int4Pairs {
  Int4Tile tile;
  mutable int64_t current = -1;
  mutable __m512 s[4], z[4];
  PAGEDSERVE_ALWAYS_INLINE void operator()(int64_t p, __m512bh& w0, __m512bh& w1) const {
    if (p / tile.group_pairs != current) load_group(p / tile.group_pairs);
    __m512 f[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i v =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile.nibbles + p * 32 + 16 * h)));
      const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
      const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      f[2 * h] = _mm512_mul_ps(_mm512_sub_ps(low, z[2 * h]), s[2 * h]);
      f[2 * h + 1] = _mm512_mul_ps(_mm512_sub_ps(high, z[2 * h + 1]), s[2 * h + 1]);
    }
    w0 = _mm512_cvtne2ps_pbh(f[1], f[0]);
    w1 = _mm512_cvtne2ps_pbh(f[3], f[2]);
  }
  void load_group(int64_t g) const {
    current = g;
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int h = 0; h < 2; ++h) {
      const __m512 scales = _mm512_loadu_ps(tile.scale + g * 32 + 16 * h);
      const __m512 zeros = _mm512_loadu_ps(tile.zero + g * 32 + 16 * h);
      s[2 * h] = _mm512_permutexvar_ps(first, scales), s[2 * h + 1] = _mm512_permutexvar_ps(second, scales);
      z[2 * h] = _mm512_permutexvar_ps(first, zeros), z[2 * h + 1] = _mm512_permutexvar_ps(second, zeros);
    }
  }
};
inline Int4Pairs pairs_of(const Int4Tile* tile) { return Int4Pairs{*tile}; }
inline void prefetch_pair(const Int4Tile* next, int64_t p) {  // one line per two column pairs
  if (p % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(next->nibbles + p * 32), _MM_HINT_T1);
}

// x [M, K] bf16, pairs: a 4-bit weight [N, K] with groups of `group` columns as pair_int4 lays it out (nibbles
// [ceil(N / 32)][K / 2][32], then scales and zero points [ceil(N / 32)][K / group][32] float32), bias [N] or null,
// y [M, N].
inline void gemv_pairs_int4(const uint16_t* x, const uint8_t* pairs, int64_t group, const uint16_t* bias,
                            uint16_t* y, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + kPairTileRows - 1) / kPairTileRows, steps = K / 2, groups = K / group;
  const float* scales = reinterpret_cast<const float*>(pairs + tiles * steps * kPairTileRows);
  const float* zeros = scales + tiles * groups * kPairTileRows;
  auto tile = [=](int64_t t) {
    return Int4Tile{pairs + t * steps * kPairTileRows, scales + t * groups * kPairTileRows,
                    zeros + t * groups * kPairTileRows, group / 2};
  };
  auto no_prefetch = [](int64_t) { return static_cast<const int8_t*>(nullptr); };  // a pair's nibbles: half a line
  if (M > 1) return gemv_pairs_buffered(x, [&](int64_t t) { return Int4Pairs{tile(t)}; }, no_prefetch, nullptr, bias, y,
                                        M, N, K);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const Int4Tile here = tile(t), next = tile(t + 1);
    pair_group(&here, x, bias, y, t * kPairTileRows, 0, 1, N, K, nullptr, t + 1 < tiles ? &next : nullptr);
  }
}
#endif

// y = x W^T + b for a 4-bit W (group 0: a scale per row), from its pairs copy where it has one (bf16 rows on
// AVX-512 BF16 CPUs), else from W.
template <typename T>
void int4_products(const T* x, const uint8_t* w, const uint8_t* pairs, const float* scale, const float* zero,
                   int64_t group, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if (pairs) return gemv_pairs_int4(x, pairs, group ? group : K, bias, y, M, N, K);
#endif
  gemv_int4(x, w, scale, zero, group ? group : K, bias, y, M, N, K);
}

}  // namespace pagedserve
