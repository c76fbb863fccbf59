// Small-batch matrix-vector products y = x W^T + b that stream W once at memory speed, bf16 widened in registers
// (12 rows or more of a plain weight go to gemm.h's register tiles; bf16 ones to gemv_bf16.h's bf16 dot products
// where the CPU has them).
// W may be int8 or fp8 e4m3 with a float32 scale per output row (weight-only quantization): y = (x . q) * scale + b,
// or per group of G input columns (GGUF's Q8_0: G = 32; fp8 block checkpoints' blocks along K): y = sum over groups
// of (x_g . q_g) * scale_g + b (gemv_scaled).
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "fp8.h"
#include "gemm.h"
#include "gemv_bf16.h"

namespace pagedserve {

// Fewer products than this (a router's few rows) run on the calling thread: waking the others costs more.
constexpr int64_t kGemvParallelMinProducts = 1 << 15;

// R weight rows against MB input rows: R * MB independent accumulators hide the FMA latency.
template <int R, int MB, typename T>
inline void dot_tile(const T* w, const float* x, float* acc, int64_t K) {
  int64_t k = 0;
#ifdef __AVX2__
  __m256 a[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) a[r][m] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(w + r * K + k);
      for (int m = 0; m < MB; ++m) a[r][m] = _mm256_fmadd_ps(wv, xv[m], a[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r * MB + m] = hsum(a[r][m]);
#else
  for (int i = 0; i < R * MB; ++i) acc[i] = 0.f;
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r * MB + m] += widen(w[r * K + k]) * x[m * K + k];
}

// One weight row against one input row, four accumulators over k: a purely sequential stream, which the
// hardware prefetchers follow better than several rows read side by side (bf16 ~25% faster at one row).
template <typename T>
inline float dot(const T* w, const float* x, int64_t K) {
  int64_t k = 0;
  float sum = 0.f;
#ifdef __AVX2__
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
  sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; k < K; ++k) sum += widen(w[k]) * x[k];
  return sum;
}

// Output rows n..n+R for input rows m0..m0+MB; W's R rows stay in L1 while the input rows pass over them.
template <int R, int MB, typename T, typename WT>
inline void output_tile(const WT* w, const float* x, const T* bias, const float* scale, T* y, int64_t n, int64_t m0,
                        int64_t N, int64_t K) {
  float acc[R * MB];
  dot_tile<R, MB>(w + n * K, x + m0 * K, acc, K);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m)
      store(acc[r * MB + m] * (scale ? scale[n + r] : 1.f) + (bias ? widen(bias[n + r]) : 0.f),
            y + (m0 + m) * N + n + r);
}

// x [M, K], w [N, K] (T, or int8 / fp8 e4m3 with scale [N]), bias [N] or null, y [M, N]; float32 accumulation,
// one rounding to T at the end.
template <typename T, typename WT = T>
void gemv(const T* x, const WT* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K,
          const float* scale = nullptr) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<WT, uint16_t>) return gemv_bf16(x, w, bias, y, M, N, K);
#endif
#ifdef __AVX2__
  if (M >= kGemmMinRows) return gemm(x, w, bias, y, M, N, K, scale);
#endif
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = widen(x[i]);
  const bool many = M * N * K >= kGemvParallelMinProducts;
  if (M == 1) {
#pragma omp parallel for schedule(static) if (many)
    for (int64_t n = 0; n < N; ++n)
      store(dot(w + n * K, xf.data(), K) * (scale ? scale[n] : 1.f) + (bias ? widen(bias[n]) : 0.f), y + n);
    return;
  }
  // Several input rows: register tiles of 4 weight rows x 2 input rows reuse every load.
  constexpr int R = 4;
  const int64_t blocks = N / R;
#pragma omp parallel for schedule(static) if (many)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t m0 = 0;
    for (; m0 + 2 <= M; m0 += 2) output_tile<R, 2>(w, xf.data(), bias, scale, y, b * R, m0, N, K);
    if (m0 < M) output_tile<R, 1>(w, xf.data(), bias, scale, y, b * R, m0, N, K);
  }
  for (int64_t n = blocks * R; n < N; ++n)
    for (int64_t m0 = 0; m0 < M; ++m0) output_tile<1, 1>(w, xf.data(), bias, scale, y, n, m0, N, K);
}

#ifdef __AVX2__
// One group's products, summed in a vector (group a multiple of 8).
template <typename WT>
inline __m256 group_products(const WT* w, const float* x, int64_t group) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t k = 0;
  for (; k + 16 <= group; k += 16) {
    a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
  }
  if (k < group) a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
  return _mm256_add_ps(a0, a1);
}
#endif

// Row w [K] (int8 or fp8) against x [K] with a scale per group of `group` columns (a multiple of 8): each group's
// products are summed in a vector and scaled once into one of two running vectors (two, so that consecutive groups
// do not wait on each other); one horizontal sum at the end.
template <typename WT>
inline float dot_grouped(const WT* w, const float* x, const float* scale, int64_t K, int64_t group) {
#ifdef __AVX2__
  __m256 t0 = _mm256_setzero_ps(), t1 = t0;
  int64_t k = 0, g = 0;
  for (; k + 2 * group <= K; k += 2 * group, g += 2) {
    t0 = _mm256_fmadd_ps(group_products(w + k, x + k, group), _mm256_set1_ps(scale[g]), t0);
    t1 = _mm256_fmadd_ps(group_products(w + k + group, x + k + group, group), _mm256_set1_ps(scale[g + 1]), t1);
  }
  if (k < K) t0 = _mm256_fmadd_ps(group_products(w + k, x + k, group), _mm256_set1_ps(scale[g]), t0);
  return hsum(_mm256_add_ps(t0, t1));
#else
  float sum = 0.f;
  for (int64_t k = 0, g = 0; k < K; ++g) {
    float part = 0.f;
    for (const int64_t end = k + group; k < end; ++k) part += widen(w[k]) * x[k];
    sum += part * scale[g];
  }
  return sum;
#endif
}

// x [M, K], w int8 or fp8 [N, K] with scale [N, K / group], bias [N] or null, y [M, N]. A weight row (K bytes)
// stays in L1 while every input row passes over it.
template <typename T, typename WT>
void gemv_grouped(const T* x, const WT* w, const float* scale, const T* bias, T* y, int64_t M, int64_t N,
                  int64_t K, int64_t group) {
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = widen(x[i]);
  const int64_t groups = K / group;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      store(dot_grouped(w + n * K, xf.data() + m * K, scale + n * groups, K, group) + (bias ? widen(bias[n]) : 0.f),
            y + m * N + n);
}

// w int8 or fp8 e4m3 [N, K] with scale [N] (group 0) or [N, K / group] (a multiple of 8) into out [N, K] of T: each
// element times its scale in float32, rounded once to T (kernels/quantized_matmul.py's dequantize), for torch's GEMMs.
template <typename T, typename WT>
void dequantize_scaled(const WT* w, const float* scale, int64_t group, T* out, int64_t N, int64_t K) {
  const int64_t width = group ? group : K, groups = K / width;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < N * groups; ++g) {
    const int64_t first = g / groups * K + g % groups * width;
    int64_t i = 0;
#ifdef __AVX2__
    for (const __m256 s = _mm256_set1_ps(scale[g]); i + 8 <= width; i += 8)
      store8(_mm256_mul_ps(load8(w + first + i), s), out + first + i);
#endif
    for (; i < width; ++i) store(widen(w[first + i]) * scale[g], out + first + i);
  }
}

// x [M, K], w int8 or fp8 e4m3 [N, K] with a float32 scale per row [N] (group 0) or per group of `group` columns
// [N, K / group] (a multiple of 8), bias [N] or null, y [M, N]: gemm.h's tiles from kGemmMinRows rows on; short of
// them, bf16 rows against fp8 weights by the bf16 dot products where the CPU has them, else gemv() or
// gemv_grouped().
template <typename T, typename WT>
void gemv_scaled(const T* x, const WT* w, const float* scale, int64_t group, const T* bias, T* y, int64_t M,
                 int64_t N, int64_t K) {
#ifdef __AVX2__
  if (M >= kGemmMinRows) return gemm(x, w, bias, y, M, N, K, scale, group);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<WT, Fp8E4m3>)
    return gemv_fp8_bf16(x, w, scale, group ? group : K, bias, y, M, N, K);
#endif
  if (group) return gemv_grouped(x, w, scale, bias, y, M, N, K, group);
  gemv(x, w, bias, y, M, N, K, scale);
}

}  // namespace pagedserve
