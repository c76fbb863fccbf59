// fp8 e4m3 weights with a float32 scale per row or per group of columns (FP8 block checkpoints) from their pairs copy
// (kernels/cpu_fp8_pairs.py's pair_fp8: the bytes in an int8 pairs copy's order, then each tile's scales), for bf16
// rows on CPUs with AVX-512 BF16 and VBMI: each byte becomes its exact bf16 value / kFp8Unit in registers by the table
// lookup int8's pairs use (fp8.h's table, no magnitude to take: the sign is the top bit), and each group's sums are
// scaled once into each row's total, as gemv_bf16.h's gemv_fp8_bf16 computes them. One input row converts in
// registers; more convert each tile once into a buffer that groups of rows then read. The same sums in the same
// order at any row count: a row's result does not depend on the rows beside it.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "fp8.h"
#include "pairs_converted.h"

namespace pagedserve {

constexpr int64_t kFp8GroupRows = 4;  // input rows per pass: a sum and a total per row and half in registers

// Column pair p of an fp8 pairs tile's 32 rows as bf16 pairs (rows 0..15 in w0, 16..31 in w1).
struct Fp8Pairs : Int8Lookup<false, uint8_t> {
  explicit Fp8Pairs(const uint8_t* t) : Int8Lookup(t, fp8_bf16_byte_tables<Fp8E4m3>()) {}
  PAGEDSERVE_ALWAYS_INLINE void operator()(int64_t p, __m512bh& w0, __m512bh& w1) const {
    const __m512i q = _mm512_loadu_si512(tile + p * 64);
    convert(q, q, w0, w1);
  }
};

// Input rows m0..m0+MB against one tile of output rows n0..n0+32: per group of group_pairs column pairs, the sums
// times the group's 32 scales (scales: the tile's [groups][32], kFp8Unit folded in) added to each row's totals.
// next: as pair_tile_of's.
template <int MB, typename Pairs>
inline void fp8_pair_tile(const Pairs& weights, const uint16_t* x, const float* scales, int64_t group_pairs,
                          const uint16_t* bias, uint16_t* y, int64_t n0, int64_t m0, int64_t N, int64_t K,
                          const uint8_t* next) {
  __m512 total[MB][2];
  for (int m = 0; m < MB; ++m) total[m][0] = total[m][1] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K / 2; g0 += group_pairs, scales += 32) {
    __m512 a[MB][2];
    for (int m = 0; m < MB; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
    for (int64_t p = g0; p < g0 + group_pairs; ++p) {
      __m512bh w0, w1;
      weights(p, w0, w1);
      if (next) prefetch_pair(next, p);
      for (int m = 0; m < MB; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + (m0 + m) * K + 2 * p, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        a[m][0] = _mm512_dpbf16_ps(a[m][0], w0, xv);
        a[m][1] = _mm512_dpbf16_ps(a[m][1], w1, xv);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(scales), s1 = _mm512_loadu_ps(scales + 16);
    for (int m = 0; m < MB; ++m) {
      total[m][0] = _mm512_fmadd_ps(a[m][0], s0, total[m][0]);
      total[m][1] = _mm512_fmadd_ps(a[m][1], s1, total[m][1]);
    }
  }
  store_tile_sums<MB>(total, nullptr, bias, y, n0, m0, N);
}

template <typename Pairs>
inline void fp8_pair_group(const Pairs& weights, const uint16_t* x, const float* scales, int64_t group_pairs,
                           const uint16_t* bias, uint16_t* y, int64_t n0, int64_t m0, int64_t MB, int64_t N,
                           int64_t K, const uint8_t* next) {
  switch (MB) {
    case 4: fp8_pair_tile<4>(weights, x, scales, group_pairs, bias, y, n0, m0, N, K, next); break;
    case 3: fp8_pair_tile<3>(weights, x, scales, group_pairs, bias, y, n0, m0, N, K, next); break;
    case 2: fp8_pair_tile<2>(weights, x, scales, group_pairs, bias, y, n0, m0, N, K, next); break;
    default: fp8_pair_tile<1>(weights, x, scales, group_pairs, bias, y, n0, m0, N, K, next); break;
  }
}

// x [M, K] bf16, pairs: an fp8 e4m3 W [N, K] with groups of `group` columns (K: a scale per row) as pair_fp8 lays it
// out (bytes [ceil(N / 32)][K / 2][64], then float32 scales [ceil(N / 32)][K / group][32]), bias [N] or null,
// y [M, N]. K and group even. Up to a group of rows convert in registers, more through a buffer (gemv_pairs_int8's
// rule); a tile's first group prefetches the next tile's bytes.
inline void gemv_pairs_fp8(const uint16_t* x, const uint8_t* pairs, int64_t group, const uint16_t* bias, uint16_t* y,
                           int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + kPairTileRows - 1) / kPairTileRows, tile_bytes = K / 2 * 64, groups = K / group;
  const float* scales = reinterpret_cast<const float*>(pairs + tiles * tile_bytes);
  auto next = [&](int64_t t) { return t + 1 < tiles ? pairs + (t + 1) * tile_bytes : nullptr; };
  if (M <= kFp8GroupRows) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t)
      fp8_pair_group(Fp8Pairs(pairs + t * tile_bytes), x, scales + t * groups * 32, group / 2, bias, y,
                     t * kPairTileRows, 0, M, N, K, next(t));
    return;
  }
  each_tile_converted([&](int64_t t) { return Fp8Pairs(pairs + t * tile_bytes); }, N, K,
                      [&](int64_t t, const uint16_t* converted) {
    for (int64_t m0 = 0; m0 < M; m0 += kFp8GroupRows)
      fp8_pair_group(Bf16Pairs{converted}, x, scales + t * groups * 32, group / 2, bias, y, t * kPairTileRows, m0,
                     std::min(kFp8GroupRows, M - m0), N, K, m0 == 0 ? next(t) : nullptr);
  });
}

}  // namespace pagedserve
#endif
