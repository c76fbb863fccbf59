// The passes sample.h builds its rows' distributions from: the largest logit, weights and their float64 sums
// per block (AVX2 where it is there), top-k's k-th largest by a cut-back candidate list, and top-p's boundary by
// radix selection over the weights' bits.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
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

#ifdef __AVX2__
// Adds v's 8 floats to float64 sums: lanes 0-3 to lo, 4-7 to hi.
inline void add_f64(__m256 v, __m256d& lo, __m256d& hi) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

inline double sum_f64(__m256d lo, __m256d hi) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}
#endif

// w[0..n) = e^((x - max) / t) where x >= floor, else 0; their sum in float64. Scaled by 1 / t where torch divides
// by t: within an ulp.
inline double weights_f64(const float* x, float* w, int64_t n, float max, float inv_t, float floor) {
  int64_t i = 0;
  double sum = 0.0;
#ifdef __AVX2__
  const __m256 m = _mm256_set1_ps(max), scale = _mm256_set1_ps(inv_t), low = _mm256_set1_ps(floor);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = _mm256_and_ps(_mm256_cmp_ps(v, low, _CMP_GE_OQ),
                                   exp8(_mm256_mul_ps(_mm256_sub_ps(v, m), scale)));
    _mm256_storeu_ps(w + i, e);
    add_f64(e, lo, hi);
  }
  sum = sum_f64(lo, hi);
#endif
  for (; i < n; ++i) sum += (w[i] = x[i] >= floor ? std::exp((x[i] - max) * inv_t) : 0.f);
  return sum;
}

// w[0..n) below floor set to 0; the sum of the rest in float64.
inline double keep_from(float* w, int64_t n, float floor) {
  int64_t i = 0;
  double sum = 0.0;
#ifdef __AVX2__
  const __m256 low = _mm256_set1_ps(floor);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(w + i);
    const __m256 kept = _mm256_and_ps(_mm256_cmp_ps(v, low, _CMP_GE_OQ), v);
    _mm256_storeu_ps(w + i, kept);
    add_f64(kept, lo, hi);
  }
  sum = sum_f64(lo, hi);
#endif
  for (; i < n; ++i) {
    if (w[i] < floor) w[i] = 0.f;
    sum += w[i];
  }
  return sum;
}

// Writes to out[count..] the values of x[0..n) at or above low (8 compared at a time where AVX2 allows), calling
// cut(count) after each, which may shrink count; returns count. out has room for n more.
template <typename Cut>
inline int64_t append_from(const float* x, int64_t n, const float& low, float* out, int64_t count, Cut&& cut) {
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + 8 <= n; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(low), _CMP_GE_OQ));
    while (mask) {
      out[count++] = x[i + __builtin_ctz(mask)];
      mask &= mask - 1;
      cut(count);
    }
  }
#endif
  for (; i < n; ++i)
    if (x[i] >= low) {
      out[count++] = x[i];
      cut(count);
    }
  return count;
}

// What sample_row works in, for rows of `vocab` logits (empty: none yet).
struct SampleScratch {
  SampleScratch() = default;
  explicit SampleScratch(int64_t vocab)
      : w(vocab), sums((vocab + kSampleBlock - 1) / kSampleBlock), values(vocab) {}

  std::vector<float> w;  // the row's weights
  std::vector<double> sums;  // of its blocks of kSampleBlock
  std::vector<float> values;  // kth_largest's candidates, top_p_boundary's: room for a row
  std::vector<double> buckets;  // top_p_boundary's histogram
};

// The k-th largest of x[0..n) (0 < k < n, no NaN): candidates at or above the k-th largest seen so far are kept,
// cut back to the k largest whenever they reach 4k, so most values cost one comparison.
inline float kth_largest(const float* x, int64_t n, int64_t k, SampleScratch& s) {
  float* kept = s.values.data();
  float low = -std::numeric_limits<float>::infinity();
  auto cut = [&](int64_t& count) {
    std::nth_element(kept, kept + (k - 1), kept + count, std::greater<float>());
    count = k;
    low = kept[k - 1];
  };
  int64_t count = append_from(x, n, low, kept, 0, [&](int64_t& count) {
    if (count >= 4 * k) cut(count);
  });
  cut(count);
  return low;
}

// A positive float's bits: an unsigned key in the floats' order.
inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// top-p's boundary among the weights w[0..n) (>= 0) summing to total: the fewest largest weights that sum to
// target = top_p x total at least are kept, the rest dropped; among weights equal to the last one kept, the first in
// token order (torch's sort may keep any of them). A weight below (1 - top_p) x total / n is surely dropped (all
// such weights together fall short of the mass left out), so only the rest are ranked: by radix selection over
// their bits, 11 at a time for two levels (each narrowing to one bucket's members), then a sort of the last
// bucket's few members.
struct TopPBoundary {
  float value = 0.f;  // weights below it are dropped (0: none)
  int64_t ties = -1;  // of the weights equal to it, how many to keep, first in token order (-1: all)
};

inline TopPBoundary top_p_boundary(const float* w, int64_t n, double total, float top_p, SampleScratch& s) {
  const double target = double(top_p) * total;
  const float skip = float((1.0 - double(top_p)) * total / double(n));
  float* values = s.values.data();
  const int64_t count = append_from(w, n, std::max(skip, std::numeric_limits<float>::min()), values, 0,
                                    [](int64_t&) {});
  constexpr int kBits = 11, kTop = 31;  // below the sign bit: exponent and mantissa
  constexpr uint32_t kBuckets = 1u << kBits;
  s.buckets.resize(kBuckets);
  double above = 0.0;  // the weight above the current bucket
  float* last = values + count;  // values[0..last): the current bucket's members
  for (int shift = kTop - kBits; shift > kTop - 3 * kBits; shift -= kBits) {
    std::fill(s.buckets.begin(), s.buckets.end(), 0.0);
    for (float* v = values; v != last; ++v)
      s.buckets[(bits_of(*v) >> shift) & (kBuckets - 1)] += *v;
    int64_t b = kBuckets - 1;
    for (; b >= 0 && above + s.buckets[b] < target; --b) above += s.buckets[b];
    if (b < 0) return {};  // short of it by rounding: keep all
    last = std::partition(values, last, [&](float v) { return ((bits_of(v) >> shift) & (kBuckets - 1)) == b; });
  }
  std::sort(values, last, std::greater<float>());
  for (float* v = values; v != last; ++v)
    if ((above += *v) >= target) {
      const float* first_tie = std::find(values, last, *v);
      const int64_t kept = v - first_tie + 1;
      return {*v, std::find_if(v + 1, last, [&](float x) { return x != *v; }) == v + 1 ? -1 : kept};
    }
  return last == values ? TopPBoundary{} : TopPBoundary{*(last - 1), -1};  // short by rounding: the bucket's all
}

// Of w[0..n)'s weights equal to value, all but the first `keep` set to 0.
inline void keep_first_ties(float* w, int64_t n, float value, int64_t keep) {
  for (int64_t i = 0; i < n; ++i)
    if (w[i] == value && keep-- <= 0) w[i] = 0.f;
}

}  // namespace pagedserve
