// y = x W^T + b for bf16 x and W on CPUs with AVX-512 BF16: vdpbf16ps multiplies 32 bf16 pairs exactly and adds
// them to 16 float32 sums in one instruction, so neither operand is widened and the products cost a quarter of
// the widen-and-FMA path's instructions. The weights stream from memory once per call. Sums in float32 (the
// instruction flushes denormal inputs and sums to zero), rounded once to bf16.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

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

// x [M, K], w [N, K], bias [N] or null, y [M, N], all bf16. One weight row at a time per thread: several rows read
// side by side (tiles of 2-4 rows) ran 1.5-2x slower at 1-8 input rows (2-core AVX-512 EPYC), the prefetchers
// following one sequential stream best. The row stays in L1 while the input rows pass over it, 4 at a time (8 from
// 16 rows on, where the sums are compute-bound and the wider block loads each weight vector fewer times).
inline void gemv_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
                      int64_t K) {
  const bool wide = M >= 16;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float b = bias ? widen(bias[n]) : 0.f;
    int64_t m0 = 0;
    if (wide)
      for (; m0 + 8 <= M; m0 += 8) output_rows_bf16<8>(w, x, b, y, n, m0, N, K);
    for (; m0 + 4 <= M; m0 += 4) output_rows_bf16<4>(w, x, b, y, n, m0, N, K);
    switch (M - m0) {
      case 3: output_rows_bf16<3>(w, x, b, y, n, m0, N, K); break;
      case 2: output_rows_bf16<2>(w, x, b, y, n, m0, N, K); break;
      case 1: output_rows_bf16<1>(w, x, b, y, n, m0, N, K); break;
      default: break;
    }
  }
}

}  // namespace pagedserve
#endif
