// y = x W^T + b for bf16 x and W (or fp8 e4m3 W converted a row at a time, with its scales) on CPUs with AVX-512 BF16:
// vdpbf16ps multiplies 32 bf16 pairs exactly and adds them to 16 float32 sums in one instruction, so neither operand is
// widened and the products cost a quarter of the widen-and-FMA path's instructions. The weights stream from memory once
// per call. Sums in float32 (the instruction flushes denormal inputs and sums to zero), rounded once to bf16.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "fp8.h"

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

// Weight rows n0..n0+NB against input rows m0..m0+MB (NB * MB = 16): 16 independent sums, so that short rows do
// not wait on one accumulator's latency, added across lanes together and rounded and stored as vectors (per-sum
// reductions and stores cost more than the products at K of a few hundred). NB + MB loads per 32 columns.
template <int NB, int MB>
inline void block_bf16(const uint16_t* w, const uint16_t* x, const uint16_t* bias, uint16_t* y, int64_t n0,
                       int64_t m0, int64_t N, int64_t K) {
  static_assert(NB * MB == 16, "a block holds 16 sums");
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  auto step = [&](int64_t k, auto load) {
    __m512bh xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = load(x + (m0 + m) * K + k);
    for (int n = 0; n < NB; ++n) {
      const __m512bh wv = load(w + (n0 + n) * K + k);
      for (int m = 0; m < MB; ++m) a[m * NB + n] = _mm512_dpbf16_ps(a[m * NB + n], wv, xv[m]);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); });
  if (k < K) {
    const __mmask32 mask = _cvtu32_mask32((1u << (K - k)) - 1);
    step(k, [mask](const uint16_t* p) { return load32(p, mask); });
  }
  __m512 sums = sum_lanes_16(a);  // lane m * NB + n: input row m0 + m, weight row n0 + n
  if (bias) {
    alignas(64) float b[16];
    for (int i = 0; i < 16; ++i) b[i] = widen(bias[n0 + i % NB]);
    sums = _mm512_add_ps(sums, _mm512_load_ps(b));
  }
  alignas(32) uint16_t out[16];
  store8(_mm512_castps512_ps256(sums), out);  // common.h's rounding, 8 lanes at a time
  store8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1)), out + 8);
  for (int m = 0; m < MB; ++m) std::memcpy(y + (m0 + m) * N + n0, out + m * NB, NB * sizeof(uint16_t));
}

// Weight rows n0..n0+16 against every input row: 4 x 4 blocks, then 8 x 2 and 16 x 1 for the rest.
inline void blocks_bf16(const uint16_t* w, const uint16_t* x, const uint16_t* bias, uint16_t* y, int64_t n0,
                        int64_t M, int64_t N, int64_t K) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4)
    for (int64_t n = n0; n < n0 + 16; n += 4) block_bf16<4, 4>(w, x, bias, y, n, m0, N, K);
  if (m0 + 2 <= M) {
    for (int64_t n = n0; n < n0 + 16; n += 8) block_bf16<8, 2>(w, x, bias, y, n, m0, N, K);
    m0 += 2;
  }
  if (m0 < M) block_bf16<16, 1>(w, x, bias, y, n0, m0, N, K);
}

// Blocks from kTileMinRows input rows on, and at any rows for a weight under kSmallWeightBytes or rows of at most
// kShortRow columns: where the products are compute- or latency-bound rather than streaming weights from memory
// (2-core AVX-512 BF16 EPYC, the demo model's 192-column matrices, against one weight row at a time: 1152 x 192 at
// 1 row 7.8 against 10.2 us on one thread, at 8 rows 17.9 against 30.1 us on two; its 4096 x 192 LM head at 8 rows
// 94 against 204 us). Short of that, one weight row at a time keeps a single sequential stream, which the
// prefetchers follow best where the weights stream from memory (the benchmark model's 33 matrices, 0.5-5.8 MB, in
// blocks: 1.43-1.48x slower at 4 rows, 1.13-1.14x at 8): the row stays in L1 while the input rows pass over it, 4 at
// a time.
constexpr int64_t kTileMinRows = 12, kSmallWeightBytes = 1 << 19, kShortRow = 256;

// x [M, K], w [N, K], bias [N] or null, y [M, N], all bf16.
inline void gemv_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
                      int64_t K) {
  const bool blocked = M >= kTileMinRows || 2 * N * K < kSmallWeightBytes || K <= kShortRow;
  const int64_t chunk = blocked ? 16 : 4;
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n1 = std::min(n0 + chunk, N);
    if (blocked && n1 - n0 == 16) {
      blocks_bf16(w, x, bias, y, n0, M, N, K);
      continue;
    }
    for (int64_t n = n0; n < n1; ++n) rows_from_bf16(w, x, bias ? widen(bias[n]) : 0.f, y, n, 0, M, N, K);
  }
}

// One weight row w [K] (bf16 of fp8 values / kFp8Unit) against input rows m0..m0+MB with a scale per group of
// `group` columns (K: one per row): each group's sums scaled once into the rows' running vectors. U sums per input
// row, taken in turn over k, so that few rows do not wait on one sum's latency.
template <int MB>
inline void dot_groups_bf16(const uint16_t* w, const uint16_t* x, int64_t K, int64_t group, const float* scale,
                            float* acc) {
  constexpr int U = MB == 1 ? 4 : MB == 2 ? 2 : 1;
  __m512 total[MB];
  for (int m = 0; m < MB; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    __m512 a[MB][U];
    for (int m = 0; m < MB; ++m)
      for (int u = 0; u < U; ++u) a[m][u] = _mm512_setzero_ps();
    auto step = [&](int64_t k, int u, __mmask32 mask) {
      const __m512bh wv = load32(w + k, mask);
      for (int m = 0; m < MB; ++m) a[m][u] = _mm512_dpbf16_ps(a[m][u], wv, load32(x + m * K + k, mask));
    };
    const __mmask32 all = _cvtu32_mask32(0xffffffffu);
    int64_t k = g0;
    for (; k + 32 * U <= g0 + group; k += 32 * U)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) step(k + 32 * u, u, all);
    for (; k + 32 <= g0 + group; k += 32) step(k, 0, all);
    if (k < g0 + group) step(k, 0, _cvtu32_mask32((1u << (g0 + group - k)) - 1));
    const __m512 s = _mm512_set1_ps(scale[g0 / group]);
    for (int m = 0; m < MB; ++m) {
      for (int u = 1; u < U; ++u) a[m][0] = _mm512_add_ps(a[m][0], a[m][u]);
      total[m] = _mm512_fmadd_ps(a[m][0], s, total[m]);
    }
  }
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_reduce_add_ps(total[m]) * kFp8Unit<Fp8E4m3>;
}

template <int MB>
inline void output_groups_bf16(const uint16_t* w, const uint16_t* x, int64_t K, int64_t group, const float* scale,
                               float bias, uint16_t* y, int64_t n, int64_t m0, int64_t N) {
  float acc[MB];
  dot_groups_bf16<MB>(w, x + m0 * K, K, group, scale, acc);
  for (int m = 0; m < MB; ++m) store(acc[m] + bias, y + (m0 + m) * N + n);
}

// x [M, K] bf16, w fp8 e4m3 [N, K] with scale [N, K / group] (group K: [N]), bias [N] or null, y [M, N]: each weight
// row converted exactly to bf16 once (fp8.h's bf16_fp8_rows) while the input rows pass over it, 4 at a time.
inline void gemv_fp8_bf16(const uint16_t* x, const Fp8E4m3* w, const float* scale, int64_t group,
                          const uint16_t* bias, uint16_t* y, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = K / group;
#pragma omp parallel
  {
    std::vector<uint16_t> row(K);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint16_t* r = bf16_fp8_rows(w + n * K, row.data(), K);
      const float* s = scale + n * groups;
      const float b = bias ? widen(bias[n]) : 0.f;
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) output_groups_bf16<4>(r, x, K, group, s, b, y, n, m0, N);
      switch (M - m0) {
        case 3: output_groups_bf16<3>(r, x, K, group, s, b, y, n, m0, N); break;
        case 2: output_groups_bf16<2>(r, x, K, group, s, b, y, n, m0, N); break;
        case 1: output_groups_bf16<1>(r, x, K, group, s, b, y, n, m0, N); break;
        default: break;
      }
    }
  }
}

}  // namespace pagedserve
#endif
