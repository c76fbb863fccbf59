// Sampling each row of float32 logits from softmax(logits / temperature) by the inverse CDF: the first token whose
// running sum passes uniform x the row's sum, the rule of Sampler._inverse_cdf (workers/layers/sampler.py), sums in
// float64. torch takes a softmax and a float64 cumsum over the whole vocabulary, a serial pass per row; here one
// pass computes the weights e^(x / t - max) and float64 sums per block of kSampleBlock tokens, the point is found
// among the blocks, and only its block is summed token by token.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace pagedserve {

constexpr int64_t kSampleBlock = 256;

// The largest of x[0..n), or NaN where one is NaN.
inline float max_or_nan(const float* x, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 mv = _mm256_set1_ps(max), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mv = _mm256_max_ps(mv, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float lane : lanes) max = std::max(max, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    max = std::max(max, x[i]);
    nan |= std::isnan(x[i]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : max;
}

// w[0..n) = e^((x - max) / t), their sum in float64. Scaled by 1 / t where torch divides by t: within an ulp.
inline double weights_f64(const float* x, float* w, int64_t n, float max, float inv_t) {
  int64_t i = 0;
  double sum = 0.0;
#ifdef __AVX2__
  const __m256 m = _mm256_set1_ps(max), scale = _mm256_set1_ps(inv_t);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m), scale));
    _mm256_storeu_ps(w + i, e);
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
  sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < n; ++i) sum += (w[i] = std::exp((x[i] - max) * inv_t));
  return sum;
}

// One row: its token, or -1 where no token has weight (every logit -inf, or a NaN). w: scratch of vocab floats,
// sums: of its blocks.
inline int64_t sample_row(const float* x, int64_t vocab, float temperature, double uniform, float* w,
                          double* sums) {
  const float max = max_or_nan(x, vocab);  // max(x) / t is max(x / t): t > 0
  if (!std::isfinite(max)) return -1;
  const float inv_t = 1.f / temperature;
  const int64_t blocks = (vocab + kSampleBlock - 1) / kSampleBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * kSampleBlock;
    total += (sums[b] = weights_f64(x + start, w + start, std::min(kSampleBlock, vocab - start), max, inv_t));
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  // Strictly below the sum, so the token found has a weight above zero (u * sum can round up to the sum).
  const double point = std::min(uniform * total, std::nextafter(total, 0.0));
  double before = 0.0;
  int64_t b = 0;
  for (; b + 1 < blocks && before + sums[b] <= point; ++b) before += sums[b];
  const int64_t start = b * kSampleBlock, end = std::min(start + kSampleBlock, vocab);
  int64_t last = -1;  // the block's last token with weight: where its own running sum falls short by rounding
  for (int64_t v = start; v < end; ++v) {
    if (w[v] > 0.f) last = v;
    before += w[v];
    if (before > point && w[v] > 0.f) return v;
  }
  return last;
}

// logits [rows, vocab]; temperature, uniform [rows]; tokens [rows] (-1: see sample_row).
inline void sample_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                        const double* uniform, int64_t* tokens) {
#pragma omp parallel
  {
    std::vector<float> w(vocab);
    std::vector<double> sums((vocab + kSampleBlock - 1) / kSampleBlock);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      tokens[r] = sample_row(logits + r * vocab, vocab, temperature[r], uniform[r], w.data(), sums.data());
  }
}

}  // namespace pagedserve
