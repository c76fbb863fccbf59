// Sampling each row of float32 logits by the inverse CDF, as Sampler._distribution and _inverse_cdf do
// (workers/layers/sampler.py): temperature, top-k, top-p and min-p, then the first token whose running sum passes
// uniform x the row's sum, sums in float64. torch sorts each row for top-p and takes a softmax and a float64 cumsum
// over the whole vocabulary, serial passes per row; here top-k's and top-p's boundaries are found by radix
// selection over the values' bits, one pass computes the weights e^((x - max) / t) and float64 sums per block of
// kSampleBlock tokens, the point is found among the blocks, and only its block is summed token by token.
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

// One row's distribution into s.w (each token's weight) and s.sums (per block of kSampleBlock): their total, or -1
// where no token has weight (every logit -inf, or a NaN). It is Sampler._distribution's: temperature, then top-k
// (logits below the k-th largest dropped; top_k <= 0 or >= vocab: none), top-p (the fewest largest weights that
// reach top_p of the rest, ties in token order; 1: none), then min-p (weights below min_p times the largest, which
// is e^0 = 1; 0: none).
inline double row_weights(const float* x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                          SampleScratch& s) {
  const float max = max_or_nan(x, vocab);  // max(x) / t is max(x / t): t > 0
  if (!std::isfinite(max)) return -1.0;
  const float kth = top_k > 0 && top_k < vocab ? kth_largest(x, vocab, top_k, s)
                                               : -std::numeric_limits<float>::infinity();
  const float inv_t = 1.f / temperature;
  const int64_t blocks = (vocab + kSampleBlock - 1) / kSampleBlock;
  float* w = s.w.data();
  double* sums = s.sums.data();
  // sums[b] = block_sum(start, length) for each block; their total.
  auto by_blocks = [&](auto&& block_sum) {
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t start = b * kSampleBlock;
      total += (sums[b] = block_sum(start, std::min(kSampleBlock, vocab - start)));
    }
    return total;
  };
  double total = by_blocks([&](int64_t start, int64_t n) {
    return weights_f64(x + start, w + start, n, max, inv_t, kth);
  });
  float floor = min_p > 0.f ? min_p : 0.f;
  if (top_p < 1.f) {
    const TopPBoundary boundary = top_p_boundary(w, vocab, total, top_p, s);
    if (boundary.ties >= 0 && boundary.value >= floor) keep_first_ties(w, vocab, boundary.value, boundary.ties);
    floor = std::max(floor, boundary.value);
  }
  if (floor > 0.f) total = by_blocks([&](int64_t start, int64_t n) { return keep_from(w + start, n, floor); });
  return total > 0.0 && std::isfinite(total) ? total : -1.0;
}

// The first token of row_weights' distribution (total > 0) whose running sum passes uniform x total.
inline int64_t draw_token(const SampleScratch& s, int64_t vocab, double total, double uniform) {
  const float* w = s.w.data();
  const int64_t blocks = (vocab + kSampleBlock - 1) / kSampleBlock;
  // Strictly below the sum, so the token found has a weight above zero (u * sum can round up to the sum).
  const double point = std::min(uniform * total, std::nextafter(total, 0.0));
  double before = 0.0;
  int64_t b = 0;
  for (; b + 1 < blocks && before + s.sums[b] <= point; ++b) before += s.sums[b];
  const int64_t start = b * kSampleBlock, end = std::min(start + kSampleBlock, vocab);
  int64_t last = -1;  // the block's last token with weight: where its own running sum falls short by rounding
  for (int64_t v = start; v < end; ++v) {
    if (w[v] > 0.f) last = v;
    before += w[v];
    if (before > point && w[v] > 0.f) return v;
  }
  return last;
}

// One row's token drawn at `uniform` from row_weights' distribution; -1 where it has none.
inline int64_t sample_row(const float* x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                          double uniform, SampleScratch& s) {
  const double total = row_weights(x, vocab, temperature, top_k, top_p, min_p, s);
  return total < 0.0 ? -1 : draw_token(s, vocab, total, uniform);
}

// As sample_row, also writing the distribution drawn from to q [vocab] (each weight over the total, float32 as the
// sampler's probabilities): a draft model's q, which verify_row then takes.
inline int64_t draft_row(const float* x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                         double uniform, float* q, SampleScratch& s) {
  const double total = row_weights(x, vocab, temperature, top_k, top_p, min_p, s);
  if (total < 0.0) return -1;
  for (int64_t v = 0; v < vocab; ++v) q[v] = float(double(s.w[v]) / total);
  return draw_token(s, vocab, total, uniform);
}

// Speculative sampling of a draft, as Sampler._verify_drafts: drawn from q [vocab] (a draft model's, draft_row's),
// it is kept where accept x q(draft) < p(draft), else the token is drawn at `uniform` from max(0, p - q); with q
// null (a one-hot guess: prompt lookup's) kept where accept < p(draft), else drawn from p without it. Where the
// residual has no weight the draft is kept; -1 where the row has no distribution. The tokens it gives follow p.
inline int64_t verify_row(const float* x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                          int64_t draft, const float* q, double accept, double uniform, SampleScratch& s) {
  double total = row_weights(x, vocab, temperature, top_k, top_p, min_p, s);
  if (total < 0.0) return -1;
  if (draft < 0 || draft >= vocab) return draw_token(s, vocab, total, uniform);
  float* w = s.w.data();
  if (accept * (q ? double(q[draft]) : 1.0) * total < double(w[draft])) return draft;
  const int64_t blocks = (vocab + kSampleBlock - 1) / kSampleBlock;
  if (q) {  // the residual max(0, p - q), in probabilities as the sampler's
    for (int64_t v = 0; v < vocab; ++v) w[v] = std::max(0.f, float(double(w[v]) / total) - q[v]);
  } else {
    w[draft] = 0.f;
  }
  // The block sums and total again (subtracting could leave a rounding crumb where the draft held all the weight).
  total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (!q && b != draft / kSampleBlock) {
      total += s.sums[b];
      continue;
    }
    s.sums[b] = 0.0;
    for (int64_t v = b * kSampleBlock; v < std::min((b + 1) * kSampleBlock, vocab); ++v) s.sums[b] += w[v];
    total += s.sums[b];
  }
  return total > 0.0 ? draw_token(s, vocab, total, uniform) : draft;
}

// logits [rows, vocab]; temperature, top_k, top_p, min_p, uniform [rows]; tokens [rows] (-1: see sample_row).
// With drafts (null: none) a row whose drafts[r] >= 0 verifies it by verify_row at accept[r], drawn from
// q [rows, vocab] (null: one-hot guesses).
inline void sample_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                        const int64_t* top_k, const float* top_p, const float* min_p, const double* uniform,
                        const int64_t* drafts, const double* accept, const float* q, int64_t* tokens) {
#pragma omp parallel
  {
    SampleScratch scratch(vocab);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      tokens[r] = drafts && drafts[r] >= 0
                      ? verify_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r], min_p[r], drafts[r],
                                   q ? q + r * vocab : nullptr, accept[r], uniform[r], scratch)
                      : sample_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r], min_p[r], uniform[r],
                                   scratch);
  }
}

// logits [rows, vocab]; temperature, top_k, top_p, min_p, uniform [rows]: a draft per row by draft_row, its
// distribution into q [rows, vocab]; tokens [rows] (-1: a row without any).
inline void draft_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                       const int64_t* top_k, const float* top_p, const float* min_p, const double* uniform, float* q,
                       int64_t* tokens) {
#pragma omp parallel
  {
    SampleScratch scratch(vocab);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      tokens[r] = draft_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r], min_p[r], uniform[r],
                            q + r * vocab, scratch);
  }
}

}  // namespace pagedserve
