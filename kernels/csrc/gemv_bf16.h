// y = x W^T + b for bf16 x and W on CPUs with AVX-512 BF16: vdpbf16ps multiplies 32 bf16 pairs exactly and adds
// them to 16 float32 sums in one instruction, so neither operand is widened and the products cost a quarter of
// the widen-and-FMA path's instructions. The weights stream from memory once per call. Sums in float32 (the
// instruction flushes denormal inputs and sums to zero), rounded once to bf16.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common.h"

namespace pagedserve {

inline __m512bh load32(const uint16_t* p, __mmask32 mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); }

// One weight row against input rows m0..m0+MB: MB sums, the weight vector loaded once per k for all of them.
template <int MB>
inline void dot_rows_bf16(const uint16_t* w, const uint16_t* x, int64_t K, float* acc) {
  __m512 a[MB];
  for (int m = 0; m < MB; ++m) a[m] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask32 mask) {
    const __m512bh wv = load32(w + k, mask);
    for (int m = 0; m < MB; ++m) a[m] = _mm512_dpbf16_ps(a[m], wv, load32(x + m * K + k, mask));
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, _cvtu32_mask32(0xffffffffu));
  if (k < K) step(k, _cvtu32_mask32((1u << (K - k)) - 1));
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_reduce_add_ps(a[m]);
}

template <int MB>
inline void output_rows_bf16(const uint16_t* w, const uint16_t* x, float bias, uint16_t* y, int64_t n, int64_t m0,
                             int64_t N, int64_t K) {
  float acc[MB];
  dot_rows_bf16<MB>(w + n * K, x + m0 * K, K, acc);
  for (int m = 0; m < MB; ++m) store(acc[m] + bias, y + (m0 + m) * N + n);
}

// Input rows m0.. of weight row n, 4 at a time.
inline void rows_from_bf16(const uint16_t* w, const uint16_t* x, float bias, uint16_t* y, int64_t n, int64_t m0,
                           int64_t M, int64_t N, int64_t K) {
  for (; m0 + 4 <= M; m0 += 4) output_rows_bf16<4>(w, x, bias, y, n, m0, N, K);
  switch (M - m0) {
    case 3: output_rows_bf16<3>(w, x, bias, y, n, m0, N, K); break;
    case 2: output_rows_bf16<2>(w, x, bias, y, n, m0, N, K); break;
    case 1: output_rows_bf16<1>(w, x, bias, y, n, m0, N, K); break;
    default: break;
  }
}

// Lane i of the result: the sum of a[i]'s 16 lanes (a transposed tree: 15 adds for 16 sums, where one
// _mm512_reduce_add_ps per sum takes 4).
inline __m512 sum_lanes_16(const __m512* a) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(pairs[2 * i]), hi = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd));
}

// Weight rows n0..n0+3 against input rows m0..m0+3: 16 sums from 8 loads per 32 columns (the rows' loop loads 5 for
// 4 sums), added across lanes together.
inline void tile_bf16(const uint16_t* w, const uint16_t* x, const uint16_t* bias, uint16_t* y, int64_t n0,
                      int64_t m0, int64_t N, int64_t K) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  auto step = [&](int64_t k, auto load) {
    __m512bh xv[4];
    for (int m = 0; m < 4; ++m) xv[m] = load(x + (m0 + m) * K + k);
    for (int n = 0; n < 4; ++n) {
      const __m512bh wv = load(w + (n0 + n) * K + k);
      for (int m = 0; m < 4; ++m) a[n * 4 + m] = _mm512_dpbf16_ps(a[n * 4 + m], wv, xv[m]);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); });
  if (k < K) {
    const __mmask32 mask = _cvtu32_mask32((1u << (K - k)) - 1);
    step(k, [mask](const uint16_t* p) { return load32(p, mask); });
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum_lanes_16(a));
  for (int n = 0; n < 4; ++n) {
    const float b = bias ? widen(bias[n0 + n]) : 0.f;
    for (int m = 0; m < 4; ++m) store(sums[n * 4 + m] + b, y + (m0 + m) * N + n0 + n);
  }
}

// 4 x 4 tiles from kTileMinRows input rows on, and from kSmallTileMinRows for a weight under kSmallWeightBytes:
// where the products are compute-bound rather than streaming weights from memory (2-core AVX-512 BF16 EPYC: the
// demo model's matrices, all under 512 KiB and cache-resident, 1.7-2.4x faster at 8 rows in a scratch harness,
// 2.0x at 4; benchmarks/cpu_gemv.py's 33 benchmark-model matrices, 0.5-5.8 MB streamed from memory: 4.82 ms against
// 3.98 at 8 rows, 5.58 against 5.86 at 12, 6.17 against 7.85 at 16).
constexpr int64_t kTileMinRows = 12, kSmallTileMinRows = 8, kSmallWeightBytes = 1 << 19;

// x [M, K], w [N, K], bias [N] or null, y [M, N], all bf16. Short of the tiles' rows, one weight row at a time per
// thread, the prefetchers following one sequential stream best where the weights stream from memory (tiles of 2-4
// weight rows ran 1.5-2x slower at 1-8 input rows in an earlier A/B): the row stays in L1 while the input rows pass
// over it, 4 at a time.
inline void gemv_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
                      int64_t K) {
  const bool tiled = M >= kTileMinRows || (M >= kSmallTileMinRows && 2 * N * K < kSmallWeightBytes);
  const int64_t tiled_rows = tiled ? M - M % 4 : 0;
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += 4) {
    const int64_t n1 = std::min(n0 + 4, N);
    int64_t m0 = 0;
    if (n1 - n0 == 4)
      for (; m0 < tiled_rows; m0 += 4) tile_bf16(w, x, bias, y, n0, m0, N, K);
    for (int64_t n = n0; n < n1; ++n) rows_from_bf16(w, x, bias ? widen(bias[n]) : 0.f, y, n, m0, M, N, K);
  }
}

}  // namespace pagedserve
#endif
