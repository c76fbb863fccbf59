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

#include "sample_filters.h"

namespace pagedserve {

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

// Sampled rows instead of the argmax (null temperature: none): a row with temperature[m] > 0 draws its tokens by
// sample.h's rules with its top_k, top_p and min_p, reading its uniform draws draws[m * columns ..] in the order
// the sampler's steps draw them (Sampler.draft, then Sampler._random_sample): one per draft a draft model draws
// for it; then in a step where no row verifies a draft one for its token; in one where some row does, one accept
// draw per token row of its own (its drafts and the token after them), then one uniform draw per token row; after
// the last step one per draft the draft model draws for the next call. drawn [M]: how many each row read.
struct RowSampling {
  const float* temperature = nullptr;
  const int64_t* top_k = nullptr;
  const float* top_p = nullptr;
  const float* min_p = nullptr;
  const double* draws = nullptr;
  int64_t columns = 0;
  int64_t* drawn = nullptr;
};

// What a sampled row's token is drawn with: its uniform draw, and the draft it verifies (-1: none), drawn from q
// (null: a one-hot guess), with its accept draw.
struct TokenDraws {
  double uniform = 0.0;
  int64_t draft = -1;
  const float* q = nullptr;
  double accept = 0.0;
};

}  // namespace pagedserve
